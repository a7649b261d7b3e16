"""A generated project keeps up with the template through cruft, and the hooks stay harmless."""

import importlib.util
import json
import os
import shutil

from conftest import TEMPLATE, run

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
             "tests/cluster/test_kubernetes.py", "tests/test_train.py")  # fmt: skip
    for name in names:
        (tmp_path / name).write_text("x")
    hook.remove_unwanted(tmp_path, {"slurm": "no", "kubernetes": "no"})
    hook.remove_unwanted(tmp_path, {"slurm": "no", "kubernetes": "no"})  # again, as cruft does on every update
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "scripts/launch.sh",
        "tests/test_train.py",
        "train.py",
    ]
    assert not (tmp_path / "k8s").exists()
    hook.remove_unwanted(tmp_path, {"slurm": "yes", "kubernetes": "yes"})
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
