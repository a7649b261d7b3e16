"""Template tests: bake the template with pytest-cookies and check what users get."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "seconds(n): about how long the test takes alone on the 2-core CI machine (the longest run first)"
    )


# The tests of minutes whose files set no `seconds` mark: about how long they take alone on the
# 2-core CI machine, by the start of their node id (a file, or a test and its parameters).
SECONDS = {
    "tests/test_zoo.py": 300,  # a group: one worker runs its 6 tests, about 300 s in all
    "tests/test_own_model.py": 165,
    "tests/test_updates.py::test_a_project_of_the_flat_machinery": 85,
    "tests/test_updates.py::test_cruft_update": 60,
    "tests/test_combinations.py": 45,  # a group
    "tests/test_bench.py::test_benchmark_runs_end_to_end": 30,
}


def expected_seconds(item):
    mark = item.get_closest_marker("seconds")
    if mark is not None:
        return mark.args[0]
    return max((seconds for start, seconds in SECONDS.items() if item.nodeid.startswith(start)), default=0)


@pytest.hookimpl(trylast=True)  # after pytest's own order (a module-scoped fixture's parameters together)
def pytest_collection_modifyitems(items):
    """The longest tests first, the others after them in their order. dev/test.sh's workers take
    the tests in this order (--dist loadgroup, each worker a few ahead): a test of minutes taken
    last would still run when the others are done, one of the 2 cores idle. (A group of
    xdist_group runs where its first test is.)"""
    items.sort(key=lambda item: -expected_seconds(item))


def run(command, cwd, timeout=900, env_override=None):
    """Run a command with this environment's tools (cookiecutter, ruff, python) first on PATH."""
    env = dict(os.environ if env_override is None else env_override)
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def bake_ok(cookies, **answers):
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == 0, result.exception
    assert result.exception is None
    return result.project_path


@pytest.fixture(scope="session")
def default_project(cookies_session):
    return bake_ok(cookies_session)


def project_files(project):
    return sorted(p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


TASKS = ("language", "vision", "tabular")  # the first is the default


# The files each optional answer keeps, as hooks/post_gen_project.py removes them otherwise.
KUBERNETES_FILES = {"k8s/trainjob.yaml", "k8s/jobset.yaml", "k8s/pvc.yaml", "Dockerfile", ".dockerignore",
                    "tests/cluster/test_kubernetes.py"}  # fmt: skip
OPTIONAL = {"slurm": {"scripts/slurm.sbatch", "docs/slurm.md"}, "kubernetes": KUBERNETES_FILES | {"docs/kubernetes.md"},
            "skypilot": {"sky.yaml", "docs/skypilot.md", "tests/cluster/test_skypilot.py"}}  # fmt: skip


def template_files(task, slurm="yes", kubernetes="no", skypilot="no"):
    """The files a project of `task` gets, as paths relative to it: the shared files of the
    template's project folder, and the task's own from tasks/<task>/ in their places, less
    the optional files the answers leave out."""
    root = TEMPLATE / "{{cookiecutter.project_slug}}"
    files = {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    shared = {str(p) for p in files if p.parts[0] != "tasks"}
    own = {str(p.relative_to(f"tasks/{task}")) for p in files if p.parts[:2] == ("tasks", task)}
    answers = (("slurm", slurm), ("kubernetes", kubernetes), ("skypilot", skypilot))
    removed = set().union(*(OPTIONAL[prompt] for prompt, answer in answers if answer != "yes"))
    return (shared | own) - removed
