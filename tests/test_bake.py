"""Bake the template and check the generated project as a user would get it."""

import ast
import os
import re
import shutil
import tomllib

import pytest
from conftest import TASKS, TEMPLATE, bake_ok, project_files, run, template_files


def test_default_bake_has_the_expected_files(default_project):
    """The default task (language) in place, no other task's files, slurm=yes: nothing removed."""
    assert default_project.name == "ddp_training"
    baked = {str(p.relative_to(default_project)) for p in project_files(default_project)}
    assert baked == template_files("language")
    assert {
        "config.py",
        "ddp_utils/__init__.py",
        "dataset.py",
        "train.py",
        "scripts/launch.sh",
        "scripts/slurm.sbatch",
    } <= baked
    assert {"prepare_data.py", "sample.py", "tests/test_task.py"} <= baked and "predict.py" not in baked


def test_github_workflow_keeps_its_expressions(default_project):
    workflow = (default_project / ".github" / "workflows" / "ci.yml").read_text()
    assert "${{ github.workflow }}-${{ github.ref }}" in workflow
    assert "download.pytorch.org/whl/cpu" in workflow and "python -m pytest" in workflow


def test_no_template_syntax_left_and_lf_endings(default_project):
    for path in project_files(default_project):
        text = path.read_bytes().decode()
        if path.name != "ci.yml":  # GitHub's own ${{ }} expressions belong there
            assert not re.search(r"\{\{|\{%|\{#", text), path
        assert "\r" not in text, path


def test_python_compiles_and_is_ruff_clean(default_project):
    for path in default_project.rglob("*.py"):
        ast.parse(path.read_text(), filename=str(path))
    check = run(["ruff", "check", "--no-cache", "."], cwd=default_project)
    assert check.returncode == 0, check.stdout
    form = run(["ruff", "format", "--check", "--no-cache", "."], cwd=default_project)
    assert form.returncode == 0, form.stdout


def test_launch_script_is_executable_and_parses(default_project):
    script = default_project / "scripts" / "launch.sh"
    assert os.access(script, os.X_OK)
    assert run(["bash", "-n", str(script)], cwd=default_project).returncode == 0


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2"}, "needs MASTER_ADDR"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"}, "NODE_RANK (2) must be less than NNODES (2)"),
        ({"NPROC_PER_NODE": "four"}, "NPROC_PER_NODE must be a whole number"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be at least 1"),
    ],
)
def test_launch_script_refuses_contradictions(default_project, env, message):
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC_PER_NODE")}
    result = run(["scripts/launch.sh"], cwd=default_project, env_override={**clean, **env})
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_prompt_values_reach_their_places(cookies):
    project = bake_ok(cookies, project_name="Vision Trainer", num_nodes="4", gpus_per_node="2", amp="fp16",
                      author_name="Ada", description="Trains things.")  # fmt: skip
    assert project.name == "vision_trainer"
    launch = (project / "scripts" / "launch.sh").read_text()
    assert (
        "NNODES=${NNODES:-${PET_NNODES:-4}}" in launch
        and "NPROC_PER_NODE=${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-2}}" in launch
    )
    assert 'knob(\n        "fp16",' in (project / "config.py").read_text()
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert (meta["name"], meta["description"], meta["authors"]) == (
        "vision_trainer",
        "Trains things.",
        [{"name": "Ada"}],
    )
    assert (project / "README.md").read_text().startswith("# Vision Trainer\n\nTrains things.")


HOSTILE = "Ünïcødé \"quoted\" 'single' back\\slash $HOME $(touch pwned) `touch pwned2` {braces} }} %} \u2603"


def test_hostile_user_text_renders_valid_files_and_runs_nothing(cookies, tmp_path):
    project = bake_ok(cookies, project_name=HOSTILE, project_slug="hostile", description=HOSTILE, author_name=HOSTILE)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == HOSTILE and meta["authors"] == [{"name": HOSTILE}]
    assert HOSTILE in (project / "README.md").read_text()
    assert not list(project.parent.rglob("pwned*")) and not list(TEMPLATE.rglob("pwned*"))
    for path in project.rglob("*.py"):
        ast.parse(path.read_text())
    assert run(["ruff", "check", "--no-cache", "."], cwd=project).returncode == 0


@pytest.mark.parametrize(
    "answer, prompt",
    [
        ("project_slug=My Project", "project_slug"),
        ("project_slug=a/b", "project_slug"),
        ("project_slug=", "project_slug"),
        ("project_slug=9lives", "project_slug"),
        ("project_name=3D Net", "project_slug"),  # the derived slug starts with a digit
        ("num_nodes=0", "num_nodes"),
        ("num_nodes=two", "num_nodes"),
        ("gpus_per_node=-1", "gpus_per_node"),
        ("gpus_per_node=1.5", "gpus_per_node"),
        ("amp=fp8", "amp"),
        ("task=audio", "task"),
        ("kubernetes=maybe", "kubernetes"),
        ("skypilot=maybe", "skypilot"),
    ],
)
def test_bad_answers_stop_with_one_line_and_leave_nothing(tmp_path, answer, prompt):
    output = tmp_path / "out"
    output.mkdir()
    result = run(["cookiecutter", "--no-input", str(TEMPLATE), "-o", str(output), answer], cwd=tmp_path)
    assert result.returncode != 0
    assert list(output.iterdir()) == []
    if prompt in ("amp", "task", "kubernetes", "skypilot"):
        # cookiecutter itself rejects a value outside a choice list, before our checks run.
        assert f"choice variable {prompt}" in result.stderr
        return
    (line,) = result.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"error: {prompt} ")


GENERATED_TESTS = TEMPLATE / "{{cookiecutter.project_slug}}" / "tests"
# The default task's own tests (tasks/language/tests/) join the shared ones in its bake.
LANGUAGE_TESTS = TEMPLATE / "{{cookiecutter.project_slug}}" / "tasks" / "language" / "tests"
GENERATED_TEST_MODULES = sorted(
    str(p.relative_to(GENERATED_TESTS)) for p in GENERATED_TESTS.rglob("test_*.py")
) + sorted(p.name for p in LANGUAGE_TESTS.glob("test_*.py"))
GENERATED_TEST_MODULES.remove("cluster/test_kubernetes.py")  # kubernetes=no here: the tabular bake runs it
GENERATED_TEST_MODULES.remove("cluster/test_skypilot.py")  # skypilot=no here: the tabular bake runs it
# The modules of a few minutes run one by one, to spread over the workers. Together: the short
# ones (each run starts Python, torch and the test data afresh), and those that share a session
# fixture's training runs (a run of its own would make them again), no group much longer than the
# longest module: the main phase cannot end before its longest test does.
TOGETHER = [
    ["test_preemption.py", "test_folder_claim.py"],  # the uninterrupted `reference.two`
    ["test_resilience.py", "test_disk_space.py"],  # `reference.two` and `.one`
    ["cluster/test_multinode.py", "test_experiments.py"],  # `one_node_run`
    ["test_config.py", "test_data.py", "test_diagnosis.py", "test_progress.py"],
    ["test_doctor.py", "test_out_of_memory.py", "test_inference.py", "test_schedule.py", "test_contract.py"],
]
GENERATED_TEST_RUNS = [" ".join(group) for group in TOGETHER]
GENERATED_TEST_RUNS += [m for m in GENERATED_TEST_MODULES if not any(m in group for group in TOGETHER)]
# These time training against a prediction: dev/test.sh runs them after the others, alone.
ALONE = {"cluster/test_network.py"}
# Run as the README's full suite runs, on pytest-xdist's 2 workers: modules of many short tests,
# independent of each other (no training run shared through a fixture, which each worker would
# make again) and timing nothing. Their run then takes a quarter less time where a core is free
# (the end of the main phase), for a few per cent more CPU (the second worker's start).
ON_TWO_WORKERS = {"test_doctor.py test_out_of_memory.py test_inference.py test_schedule.py test_contract.py"}
# About how long each run takes alone on the 2-core CI machine, in seconds (a run not named here:
# under a minute). Only their order matters: tests/conftest.py collects the longest first.
SECONDS = {
    "test_preemption.py test_folder_claim.py": 270,
    "test_resilience.py test_disk_space.py": 200,
    "test_activation_checkpointing.py": 190,
    "test_streaming.py": 210,
    "test_fsdp.py": 210,
    "test_cpu_offload.py": 150,
    "test_correctness.py": 185,
    "cluster/test_multinode.py test_experiments.py": 175,
    "test_task.py": 140,
    "test_muon.py": 130,
    "test_chaos.py": 120,
    "test_config.py test_data.py test_diagnosis.py test_progress.py": 115,
    "test_doctor.py test_out_of_memory.py test_inference.py test_schedule.py test_contract.py": 115,  # on 2 workers (150 s on one)
    "test_sweep.py": 125,
    "test_observability.py": 85,
    "cluster/test_sweep_array.py": 70,
    "cluster/test_slurm.py": 60,
    "test_train.py": 55,
}


def test_each_generated_module_runs_once():
    """Every module of the generated suite is in one run of test_default_project_suite, once; the
    runs named in SECONDS and ON_TWO_WORKERS are among them."""
    assert sorted(m for run in GENERATED_TEST_RUNS for m in run.split()) == sorted(GENERATED_TEST_MODULES)
    assert set(SECONDS) | ON_TWO_WORKERS <= set(GENERATED_TEST_RUNS) - ALONE


@pytest.mark.parametrize(
    "modules",
    [pytest.param(m, marks=pytest.mark.alone if m in ALONE else pytest.mark.seconds(SECONDS.get(m, 0)))
     for m in GENERATED_TEST_RUNS],
)  # fmt: skip
def test_default_project_suite(default_project, modules):
    """The default bake (language, amp bf16) passes every module of its own suite, real
    2-process runs included; a few modules per test so that they spread over the workers."""
    paths = [f"tests/{module}" for module in modules.split()]
    workers = ["-n", "2"] if modules in ON_TWO_WORKERS else []
    # The longest run takes about 270 s alone here, twice that beside 3 others on 2 cores: 1800 s before a hang is called.
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--full", *workers, *paths]
    result = run(command, cwd=default_project, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and (" passed" in result.stdout or " skipped" in result.stdout)


# The quick check a plain `pytest` runs in a bake: the guarantees a swapped model or data can
# break, a few minutes on 2 cores (docs/guarantees.md). A test joins it only by its `quick` mark.
QUICK_CHECK = [
    "tests/test_contract.py::test_the_shipped_task_has_no_near_miss",
    "tests/test_correctness.py::test_world_size_and_accumulation_give_the_same_parameters",
    "tests/test_correctness.py::test_world_size_and_accumulation_give_the_same_gradients",
    "tests/test_correctness.py::test_world_size_and_accumulation_give_the_same_metrics",
    "tests/test_correctness.py::test_accumulation_all_reduces_once_per_optimizer_step",
    "tests/test_correctness.py::test_evaluation_counts_every_sample_once",
    "tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",
    "tests/test_experiments.py::test_example_experiments_are_valid_configs[quick_cpu.toml]",
    "tests/test_experiments.py::test_example_experiments_are_valid_configs[multinode_gpu.toml]",
    "tests/test_fsdp.py::test_fsdp_trains_the_same_parameters_as_ddp",
    "tests/test_fsdp.py::test_both_strategies_start_from_the_weights_the_model_makes",
    "tests/test_preemption.py::test_sigterm_to_torchrun_saves_mid_epoch_and_resume_is_exact",
    "tests/test_resilience.py::test_resume_mid_epoch_is_bit_identical",
]


def collected(project, *args):
    result = run(["python", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args], cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if line.startswith("tests/")]


@pytest.mark.seconds(40)
def test_a_plain_pytest_is_the_quick_check_and_an_unmarked_module_runs_in_the_full_suite(default_project, tmp_path):
    """`pytest` collects the tests marked quick, and nothing else; `pytest --full` everything. A
    module added without a mark (as anyone adds one) is in the full suite, not the quick check;
    a file or test named on the command line runs whatever its marks."""
    project = tmp_path / "project"
    shutil.copytree(default_project, project)
    (project / "tests" / "test_added_later.py").write_text("def test_something_new():\n    pass\n")
    assert collected(project) == QUICK_CHECK
    everything = collected(project, "--full")
    assert set(QUICK_CHECK) < set(everything) and "tests/test_added_later.py::test_something_new" in everything
    assert len(everything) > 10 * len(QUICK_CHECK)
    assert collected(project, "tests/test_added_later.py") == ["tests/test_added_later.py::test_something_new"]
    assert len(collected(project, "tests/test_fsdp.py")) > 2  # a named file: all of it


# The other tasks' own tests, and the shared guarantees that depend on the model and data,
# which the doctor checks on the task's model and data: world-size equivalence (its 1 vs 2
# processes and sharded steps: DDP with accumulation, fsdp and hsdp in 2 gloo processes
# against one, in float64; its data per rank) and exact mid-epoch resume (its exact resume,
# and its data position: a resume's batches against an uninterrupted run's, read by a loader
# worker as train.py builds it, persistent across epochs). Every other shared test exercises
# train.py, which is the same for every task: the default bake runs them, and
# test_own_model.py the world-size and SIGTERM tests on a third model (a tabular bake: its
# dataset in DataLoader workers through a SIGTERM).
TASK_TESTS = [
    "tests/test_task.py",
    "tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",
    "tests/test_experiments.py::test_example_experiments_are_valid_configs",
    # Muon on the task's own layers (a ResNet's kernels, an MLP's hidden layer): torch's update
    # to the bit, 1 vs 2 processes, each rank its share, fsdp against ddp, where a layer's shape
    # decides what Muon does.
    "tests/test_muon.py::test_the_update_is_torch_optim_muons_to_the_bit",
    "tests/test_muon.py::test_world_size_and_accumulation_give_the_same_parameters_under_muon",
    "tests/test_muon.py::test_each_rank_orthogonalises_its_share_of_the_matrices",
    "tests/test_muon.py::test_fsdp_orthogonalises_whole_matrices_and_trains_ddps_parameters_under_muon",
    # The task's own sweep files (experiments/sweep_*.toml) name Config fields of its own.
    "tests/test_sweep.py::test_the_example_sweep_files_are_valid",
    # The task's own shards (make_shards.py) streamed from a real S3 API: 1 vs 2 processes, SIGTERM.
    "tests/test_streaming.py",
]


# The tabular bake also answers kubernetes=yes and skypilot=yes and runs their tests (the
# default bake has neither), and runs --strategy fsdp (the default bake runs all of test_fsdp.py on the GPT;
# test_own_model.py trains a third model under both strategies).
EXTRA = {
    "tabular": (
        {"kubernetes": "yes", "skypilot": "yes"},
        [
            "tests/cluster/test_kubernetes.py",
            "tests/cluster/test_skypilot.py",
            "tests/test_fsdp.py::test_both_strategies_start_from_the_weights_the_model_makes",
            "tests/test_fsdp.py::test_export_writes_one_weights_only_file_with_the_run_validation_loss",
        ],
    ),
    # The ResNet's own initialisation (its last BatchNorm of each block at zero) is kept.
    "vision": ({}, ["tests/test_fsdp.py::test_both_strategies_start_from_the_weights_the_model_makes"]),
}


# A bake's tests in one run, but the tabular bake's (the longest) in two, its TASK_TESTS and its
# EXTRA, to spread over the workers: (task, part, seconds alone on the 2-core CI machine).
OTHER_TASK_RUNS = [("vision", "all", 340), ("tabular", "task", 300), ("tabular", "extra", 135)]


def test_each_other_task_runs_all_its_tests():
    """Every task but the default has its runs: one of all its tests, or one of each part."""
    parts = {task: sorted(part for t, part, _ in OTHER_TASK_RUNS if t == task) for task in TASKS[1:]}
    assert set(parts) == {task for task, _, _ in OTHER_TASK_RUNS}
    assert all(runs in (["all"], ["extra", "task"]) for runs in parts.values()), parts


@pytest.mark.parametrize(
    "task, part",
    [pytest.param(task, part, marks=pytest.mark.seconds(seconds), id=task if part == "all" else f"{task}-{part}")
     for task, part, seconds in OTHER_TASK_RUNS],
)  # fmt: skip
def test_other_tasks_pass_their_tests(cookies, task, part):
    answers, extra_tests = EXTRA.get(task, ({}, []))
    project = bake_ok(cookies, task=task, **answers)
    tests = [*(TASK_TESTS if part in ("all", "task") else []), *(extra_tests if part in ("all", "extra") else [])]
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--full", *tests], cwd=project)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and " passed" in result.stdout


@pytest.mark.seconds(70)
def test_readme_quick_start_runs_as_written_with_two_nodes(cookies, tmp_path):
    """num_nodes=2 makes launch.sh default to two nodes; the quick start still runs on this
    machine. Each command as written (the CPU ones at experiments/quick_cpu.toml's sizes, one
    process and two; the GPU one at the defaults), with a smaller run and its own output
    folder appended (the tabular task: no data to prepare)."""
    project = bake_ok(cookies, num_nodes="2", gpus_per_node="2", task="tabular")
    readme = (project / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    commands = [c for c in commands if c and not c.startswith(("python -m venv", "pip ", "pytest"))]
    assert len(commands) == 3 and any("scripts/launch.sh" in c for c in commands), commands
    assert sum("--config experiments/quick_cpu.toml" in c for c in commands) == 2, commands
    small = "--epochs 1 --train_samples 2048 --val_samples 256 --hidden_dim 32"
    for number, command in enumerate(commands):
        result = run(["bash", "-c", f"{command} {small} --output_dir runs/quick_{number}"], cwd=project)
        assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-3000:])
        assert (project / "runs" / f"quick_{number}" / "metrics.jsonl").exists(), command


@pytest.mark.parametrize("amp", ["fp16"])
@pytest.mark.seconds(45)
def test_other_amp_defaults_train(cookies, amp):
    """With another default amp, a 2-process run with the defaults trains, learns and writes
    complete checkpoints (test_train.py's tests on its shared run); every other test sets --amp
    itself or does not train, and ran with the default bake already. (amp=none is not baked
    here: it renders like the others, test_combinations.py, and every test marked fixed_amp
    trains with --amp none.)"""
    project = bake_ok(cookies, amp=amp, task="tabular")  # the default task's runs cost the same
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--full", "-m", "not fixed_amp", "tests/test_train.py",
               "-k", "not single_process and not second_dataset"]  # fmt: skip
    result = run(command, cwd=project)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and (" passed" in result.stdout or " skipped" in result.stdout)


def test_an_install_adds_the_machinery_and_no_generic_top_level_module(default_project, tmp_path):
    """`pip install .` (not editable) installs the whole ddp_utils package, every folder of it, and nothing else at the
    top level: the files at the project's root (config.py, model.py, task.py, ...) are the
    user's and run from the project's folder; installed, `config` or `model` would collide with
    any other module of that name. Every ddp_utils module imports from the installed copy."""
    target = tmp_path / "site"
    result = run(["python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
                  str(default_project)], cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    installed = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert installed == ["ddp_utils"], installed

    def modules(root):  # every module of the package, its folders' too, as dotted names
        return sorted(".".join(p.relative_to(root).with_suffix("").parts) for p in (root / "ddp_utils").rglob("*.py"))

    machinery = modules(default_project)
    assert len({m.rpartition(".")[0] for m in machinery}) > 5, machinery  # the package's folders are seen
    assert modules(target) == machinery
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = run(["python", "-c", code, *machinery], cwd=tmp_path, env_override=env)  # not the project folder
    assert result.returncode == 0, result.stderr[-3000:]
