"""Template tests: bake the template with pytest-cookies and check what users get."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


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
