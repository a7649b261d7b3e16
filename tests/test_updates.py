"""A generated project keeps up with the template through cruft, and the hooks stay harmless."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

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
# The last commit of the flat machinery (issue 62): ddp_utils/ held its 44 modules side by side
# (trainer.py, checkpoint.py, dist.py ...), where they are in folders now (train/, checkpoint/ ...).
FLAT_LAYOUT = "12d1195"
# The user's own edit in a generated project: a default of model.py (experiments/tiny.toml sets
# its own n_layer, so the tiny runs train the same model with or without it).
TEMPLATE_DEFAULT, USERS_DEFAULT = "n_layer: int = knob(6,", "n_layer: int = knob(4,"


def template_at(tmp_path, commit):
    """A git repository at tmp_path/template holding the template as `commit` had it."""
    have = run(["git", "-C", str(TEMPLATE), "cat-file", "-e", f"{commit}^{{commit}}"], cwd=tmp_path)
    assert have.returncode == 0, f"commit {commit} is not in this clone (a shallow one?): {have.stderr}"
    template = tmp_path / "template"
    template.mkdir()
    archive = subprocess.run(["git", "-C", str(TEMPLATE), "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(template)], input=archive.stdout, check=True)
    git(template, "init", "-q")
    commit_all(template, f"the template at {commit}")
    return template


def create_project(tmp_path, template):
    """`cruft create` with the default answers (the language task), into tmp_path/projects."""
    created = run(["cruft", "create", "--no-input", str(template), "--output-dir", str(tmp_path / "projects")],
                  cwd=tmp_path)  # fmt: skip
    assert created.returncode == 0, created.stderr
    return tmp_path / "projects" / "ddp_training"


def commit_with_users_edit(project):
    """The generated project committed in a git repository, then the user's own default on top."""
    git(project, "init", "-q")
    commit_all(project, "generated")
    model = project / "model.py"
    model.write_text(model.read_text().replace(TEMPLATE_DEFAULT, USERS_DEFAULT, 1))
    assert USERS_DEFAULT in model.read_text()
    commit_all(project, "the user's own default")


def update_to_this_template(tmp_path, template, project):
    """The template's next commit is this working tree; `cruft update` takes the project to it:
    exactly what a fresh bake of it makes, but .cruft.json and the user's edit, kept."""
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
    expected_model = (expected / "model.py").read_text()
    assert TEMPLATE_DEFAULT in expected_model
    assert (project / "model.py").read_text() == expected_model.replace(TEMPLATE_DEFAULT, USERS_DEFAULT, 1)


def test_cruft_update_takes_a_project_from_the_previous_layout_to_this_one(tmp_path):
    """A project made by the commit before the layout changed, with an edit of the user's own
    (a default in model.py), is updated by `cruft update` to exactly what this template makes,
    the user's edit kept; the updated project trains."""
    template = template_at(tmp_path, PREVIOUS_LAYOUT)
    project = create_project(tmp_path, template)
    assert (project / "setup.py").exists() and "class Trainer" in (project / "train.py").read_text()
    commit_with_users_edit(project)
    update_to_this_template(tmp_path, template, project)
    helped = run(["python", "train.py", "--help"], cwd=project)
    assert helped.returncode == 0 and "--n_layer" in helped.stdout and "(default: 4)" in helped.stdout, helped.stderr


# Two processes (gloo, CPU) on the tiny model: a checkpoint and a metrics line every 2 steps,
# in float32 (--amp none) at a constant learning rate, so that a run of 4 steps is the first
# half of a run of 8 with the same flags, bit for bit.
TRAINING = ["--config", "experiments/tiny.toml", "--train_samples", "256", "--val_samples", "64", "--batch_size", "16",
            "--checkpoint_every_steps", "2", "--eval_every_steps", "2", "--lr_schedule", "constant", "--amp", "none",
            "--log_every_steps", "1", "--progress_bar", "false", "--device", "cpu"]  # fmt: skip
# A metrics line's timings, which differ from run to run (the project's tests/conftest.py TIMINGS):
# every other number of it two runs of the same training share.
TIMINGS = {"samples_per_s", "tokens_per_s", "data_wait_s", "compute_s", "checkpoint_s", "cpu_s", "peak_memory_mb",
           "mfu"}  # fmt: skip
# The model's parameters in each checkpoint named (a one-file last.pt, or a DCP folder of
# --strategy fsdp), compared pairwise: for each pair, the names of those not equal bit for bit (JSON).
SAME_PARAMETERS = """
import json, sys, tempfile
from pathlib import Path
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def model(path):
    if Path(path).is_dir():
        path, folder = Path(tempfile.mkdtemp()) / "whole.pt", path
        dcp_to_torch_save(folder, path)
    return torch.load(path, map_location="cpu", weights_only=True)["model"]

differ = []
for ours, theirs in zip(sys.argv[1::2], sys.argv[2::2]):
    a, b = model(ours), model(theirs)
    differ.append(sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])))
print(json.dumps(differ))
"""


def train(project, data, output_dir, strategy, max_steps):
    """train.py under torchrun, 2 processes; its output (stdout and stderr: the log)."""
    command = ["torchrun", "--standalone", "--nproc_per_node=2", "train.py", *TRAINING, "--data_dir", str(data),
               "--strategy", strategy, "--max_steps", str(max_steps), "--output_dir", str(output_dir)]  # fmt: skip
    result = run(command, cwd=project, timeout=300)
    assert result.returncode == 0, f"{strategy}, {max_steps} steps:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_project_of_the_flat_machinery_updates_and_resumes_its_checkpoints(tmp_path):
    """A project made by the last commit of the flat ddp_utils/, with an edit of the user's own,
    trains 4 steps under ddp and under fsdp (one-file and sharded checkpoints), is updated by
    `cruft update` to this template's folders, and the same commands with --max_steps 8 resume
    each run from its step-4 checkpoint and finish: metrics.jsonl goes on from its lines, and
    the run ends bit for bit as a run of the updated project that was never interrupted."""
    template = template_at(tmp_path, FLAT_LAYOUT)
    project = create_project(tmp_path, template)
    machinery = project / "ddp_utils"
    assert (machinery / "trainer.py").exists() and not (machinery / "train").exists()
    commit_with_users_edit(project)
    data = tmp_path / "data"  # outside the project: the update's comparison sees the project's files alone
    prepared = run(["python", "prepare_data.py", "--max_bytes", "200000", "--output_dir", str(data)], cwd=project)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    runs, strategies = tmp_path / "runs", ("ddp", "fsdp")
    for strategy in strategies:
        train(project, data, runs / strategy, strategy, max_steps=4)
    before = {strategy: (runs / strategy / "metrics.jsonl").read_text() for strategy in strategies}
    assert (runs / "ddp" / "checkpoints" / "step_000000004.pt").is_file()
    assert (runs / "fsdp" / "checkpoints" / "last").resolve().name == "step_000000004"

    update_to_this_template(tmp_path, template, project)
    assert (machinery / "train" / "trainer.py").exists() and not (machinery / "trainer.py").exists()

    pairs = []
    for strategy in strategies:
        output = train(project, data, runs / strategy, strategy, max_steps=8)
        resumed = re.search(r"resumed from (\S+): epoch 1, step (\d+)", output)  # the checkpoint it read
        assert resumed and Path(resumed.group(1)).parent == runs / strategy / "checkpoints", output
        assert resumed.group(2) == "4", output
        assert "step 4 loss" not in output and "step 5 loss" in output and "step 8 loss" in output, output
        assert (runs / strategy / "metrics.jsonl").read_text().startswith(before[strategy])
        assert [line["step"] for line in metrics(runs / strategy)] == [2, 4, 6, 8]

        train(project, data, runs / f"uninterrupted-{strategy}", strategy, max_steps=8)
        ours, theirs = (
            [{key: value for key, value in line.items() if key not in TIMINGS} for line in metrics(output_dir)]
            for output_dir in (runs / strategy, runs / f"uninterrupted-{strategy}")
        )
        assert ours == theirs, strategy
        last = "last.pt" if strategy == "ddp" else "last"
        pairs += [runs / strategy / "checkpoints" / last, runs / f"uninterrupted-{strategy}" / "checkpoints" / last]
    compared = run(["python", "-c", SAME_PARAMETERS, *map(str, pairs)], cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert json.loads(compared.stdout) == [[], []], "parameters differ from the uninterrupted run's (ddp, fsdp)"
