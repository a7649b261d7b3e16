"""A generated project keeps up with the template through cruft, and the hooks stay harmless."""

import importlib.util
import json
import os
import shutil
import subprocess

from conftest import TEMPLATE, project_files, run

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip


def git(cwd, *args):
    result = run(["git", *args], cwd=cwd, env_override={**os.environ, **GIT_ENV})
    assert result.returncode == 0, result.stderr
    return result.stdout


def commit_all(cwd, message):
    git(cwd, "add", "-A")
    git(cwd, "commit", "-q", "-m", message)


def test_cruft_update_applies_a_template_change(tmp_path):
    template = tmp_path / "template"
    shutil.copytree(TEMPLATE, template, ignore=shutil.ignore_patterns(".venv", "demo", ".git", "__pycache__"))
    git(template, "init", "-q")
    commit_all(template, "template v1")

    created = run(["cruft", "create", "--no-input", str(template), "--output-dir", str(tmp_path / "projects")],
                  cwd=tmp_path)  # fmt: skip
    assert created.returncode == 0, created.stderr
    project = tmp_path / "projects" / "ddp_training"
    assert json.loads((project / ".cruft.json").read_text())["template"] == str(template)
    git(project, "init", "-q")
    commit_all(project, "generated")

    readme = template / "{{cookiecutter.project_slug}}" / "README.md"
    readme.write_text(readme.read_text() + "\n## Added by a later template version\n")
    commit_all(template, "template v2")

    updated = run(["cruft", "update", "--skip-apply-ask"], cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert (project / "README.md").read_text().endswith("## Added by a later template version\n")
    assert json.loads((project / ".cruft.json").read_text())["commit"] == git(template, "rev-parse", "HEAD").strip()
    assert (project / "scripts" / "slurm.sbatch").exists()  # the hooks re-ran without harm


def load_hook(name):
    spec = importlib.util.spec_from_file_location(name, TEMPLATE / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_post_gen_hook_only_removes_listed_files_and_is_idempotent(tmp_path):
    hook = load_hook("post_gen_project")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "k8s").mkdir()
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    names = ("scripts/slurm.sbatch", "scripts/launch.sh", "train.py", "k8s/jobset.yaml", "Dockerfile",
             "tests/cluster/test_kubernetes.py", "tests/test_train.py", "sky.yaml",
             "tests/cluster/test_skypilot.py")  # fmt: skip
    for name in names:
        (tmp_path / name).write_text("x")
    none = {"slurm": "no", "kubernetes": "no", "skypilot": "no"}
    hook.remove_unwanted(tmp_path, none)
    hook.remove_unwanted(tmp_path, none)  # again, as cruft does on every update
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "scripts/launch.sh",
        "tests/test_train.py",
        "train.py",
    ]
    assert not (tmp_path / "k8s").exists()
    hook.remove_unwanted(tmp_path, {"slurm": "yes", "kubernetes": "yes", "skypilot": "yes"})
    assert (tmp_path / "train.py").exists()


def test_post_gen_hook_puts_the_chosen_task_in_place_once(tmp_path):
    hook = load_hook("post_gen_project")
    for task in ("language", "vision"):
        (tmp_path / "tasks" / task / "tests").mkdir(parents=True)
        (tmp_path / "tasks" / task / "model.py").write_text(task)
        (tmp_path / "tasks" / task / "tests" / "test_task.py").write_text(task)
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    (tmp_path / "train.py").write_text("shared")
    hook.place_task_files(tmp_path, "vision")
    hook.place_task_files(tmp_path, "vision")  # again, as cruft does on every update: no change
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["model.py", "tests/test_task.py", "train.py"]
    assert (tmp_path / "model.py").read_text() == "vision"


# The last commit of the layout before the front door (issue 44): train.py held the Trainer,
# config.py the parser, doctor.py, preflight.py and export.py the machinery, tests/task.py the
# tests' settings, setup.py installed every root file.
PREVIOUS_LAYOUT = "9edf4c0"


def test_cruft_update_takes_a_project_from_the_previous_layout_to_this_one(tmp_path):
    """A project made by the commit before the layout changed, with an edit of the user's own
    (a default in model.py), is updated by `cruft update` to exactly what this template makes,
    the user's edit kept; the updated project trains."""
    have = run(["git", "-C", str(TEMPLATE), "cat-file", "-e", f"{PREVIOUS_LAYOUT}^{{commit}}"], cwd=tmp_path)
    assert have.returncode == 0, f"commit {PREVIOUS_LAYOUT} is not in this clone (a shallow one?): {have.stderr}"
    template = tmp_path / "template"
    template.mkdir()
    archive = subprocess.run(["git", "-C", str(TEMPLATE), "archive", PREVIOUS_LAYOUT], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(template)], input=archive.stdout, check=True)
    git(template, "init", "-q")
    commit_all(template, "the previous layout")
    created = run(["cruft", "create", "--no-input", str(template), "--output-dir", str(tmp_path / "projects")],
                  cwd=tmp_path)  # fmt: skip
    assert created.returncode == 0, created.stderr
    project = tmp_path / "projects" / "ddp_training"
    assert (project / "setup.py").exists() and "class Trainer" in (project / "train.py").read_text()
    git(project, "init", "-q")
    commit_all(project, "generated")
    model = project / "model.py"
    model.write_text(model.read_text().replace("n_layer: int = knob(6,", "n_layer: int = knob(4,", 1))
    assert "n_layer: int = knob(4," in model.read_text()
    commit_all(project, "the user's own default")

    for path in list(template.iterdir()):
        if path.name != ".git":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    ignore = shutil.ignore_patterns(".venv", "demo", ".git", "__pycache__", ".pytest_cache", ".ruff_cache")
    shutil.copytree(TEMPLATE, template, ignore=ignore, dirs_exist_ok=True)
    commit_all(template, "this layout")
    updated = run(["cruft", "update", "--skip-apply-ask"], cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert not list(project.rglob("*.rej")), "cruft could not apply part of the update"

    fresh = run(["cookiecutter", "--no-input", str(template), "--output-dir", str(tmp_path / "fresh")], cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    expected = tmp_path / "fresh" / "ddp_training"

    def tree(root):
        return sorted(str(p.relative_to(root)) for p in project_files(root) if ".git" not in p.relative_to(root).parts)

    assert [p for p in tree(project) if p != ".cruft.json"] == tree(expected)
    for relative in tree(expected):
        if relative != "model.py":
            assert (project / relative).read_bytes() == (expected / relative).read_bytes(), relative
    assert (project / "model.py").read_text() == (expected / "model.py").read_text().replace(
        "n_layer: int = knob(6,", "n_layer: int = knob(4,", 1
    )
    assert "n_layer: int = knob(4," in (project / "model.py").read_text()
    helped = run(["python", "train.py", "--help"], cwd=project)
    assert helped.returncode == 0 and "--n_layer" in helped.stdout and "(default: 4)" in helped.stdout, helped.stderr
