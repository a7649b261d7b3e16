"""Models nobody here wrote: tiny, randomly initialised architectures from the Hugging Face zoo
(`transformers`, built from their configs offline), each dropped into a bake's model.py as the
README's checklist says (tests/zoo/: a module whose forward returns `.logits`, and build_model
returning it; nothing else of the project edited). Each passes the doctor (no FAIL; a model that
computes in float32 inside gets a WARN naming where), trains under ddp with the FLOP counter on
(MFU, or one warning saying why not: never a crash) and under fsdp, each with activation
checkpointing on (the doctor's checks with ops, which it measures keeping fewer activations than
none, as every mode; ddp with every_other, fsdp with full); the Llama also passes the
project's own tests of the guarantees that depend on the model (1 vs 2 processes and
accumulation, exact resume after SIGTERM, fsdp = ddp, the initial weights kept: its quick check)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import bake_ok, run

pytestmark = pytest.mark.xdist_group("zoo")  # one worker bakes the two projects once

ZOO = Path(__file__).resolve().parent / "zoo"
# name: (task, the 1 vs 2 processes row's status and what it names)
MODELS = {
    "llama": ("language", "pass", "1e-10"),  # RoPE, RMSNorm, grouped-query attention
    "gpt_neox": ("language", "pass", "1e-10"),  # parallel attention and MLP, partial rotary
    "mixtral": ("language", "pass", "1e-10"),  # a mixture of experts, 2 of 4 a token
    # A state-space model that runs its scan in float32 whatever it is given: a warning naming it.
    "mamba": ("language", "warn", "A_log (float)"),
    "vit": ("vision", "pass", "1e-10"),
}
# The rows that compare two runs of the model exactly; none may fail, each must have run.
COMPARISONS = ("1 vs 2 processes", "exact resume", "fsdp = ddp", "sharded steps")


@pytest.fixture(scope="module")
def zoo_projects(cookies_session):
    """A language and a vision bake, each with its zoo file appended to model.py and its demo
    data prepared (language: 200 kB of the standard library's source)."""
    projects = {}
    for task, prepare in (("language", ["--max_bytes", "200000"]), ("vision", [])):
        project = bake_ok(cookies_session, task=task, project_name=f"Zoo {task}")
        with open(project / "model.py", "a") as model:
            model.write("\n\n" + (ZOO / f"{task}.py").read_text())
        result = run(["python", "prepare_data.py", *prepare], cwd=project)
        assert result.returncode == 0, result.stderr[-2000:]
        projects[task] = project
    return projects


def zoo_env(name):
    return dict(os.environ, ZOO_MODEL=name)


STEPS = 24  # evaluated every 8: a tiny ViT on the digits learns slowly


def torchrun(project, name, output_dir, *args):
    """train.py on 2 processes at the model's tiny sizes, STEPS steps of 16 samples."""
    command = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    command += ["--config", "experiments/tiny.toml", "--amp", "none", "--output_dir", str(output_dir), *args]
    command += ["--max_steps", str(STEPS), "--eval_every_steps", "8", "--batch_size", "8", "--lr", "0.003"]
    return run(command, cwd=project, timeout=600, env_override=zoo_env(name))


def trained(output_dir):
    """Whether the run ended at its last step with a lower validation loss than at its first
    evaluation (a third of the way)."""
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return lines[-1]["step"] == STEPS and lines[-1]["val_loss"] < lines[0]["val_loss"], lines


@pytest.mark.parametrize("name", MODELS)
def test_a_zoo_model_passes_the_doctor_and_trains_under_ddp_and_fsdp(zoo_projects, name, tmp_path):
    task, status, named = MODELS[name]
    project = zoo_projects[task]
    doctor = ["python", "doctor.py", "--config", "experiments/tiny.toml", "--output_dir", str(tmp_path / "doctor")]
    doctor += ["--activation_checkpointing", "ops"]  # its steps, processes and memory plan on the checkpointed model
    result = run(doctor, cwd=project, timeout=600, env_override=zoo_env(name))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "doctor" / "doctor.json").read_text())
    rows = {row["check"]: row for row in report["checks"]}
    # The knob takes effect: the activations the doctor measures with each mode, fewer than none's
    # (the memory plan's with the configured ops among them).
    modes = {mode: measured["activations"] for mode, measured in report["activation_checkpointing"].items()}
    planned = report["memory_bytes_per_gpu"][report["configured"]]["activations"]
    assert set(modes) == {"none", "full", "every_other", "ops"} and planned == modes["ops"], (planned, modes)
    assert all(modes[mode] < modes["none"] for mode in modes if mode != "none"), modes
    assert not [row for row in rows.values() if row["status"] == "fail"], rows
    assert all(rows[check]["status"] in ("pass", "warn") for check in COMPARISONS), rows
    assert not [check for check in COMPARISONS if "not checked" in rows[check]["summary"]], rows
    assert rows["1 vs 2 processes"]["status"] == status and named in rows["1 vs 2 processes"]["summary"], rows

    # ddp (every_other on), with a peak given so that the FLOPs of a sample are counted on the meta device: a
    # model whose forward cannot run there (Mixtral's routing reads values) is reported, never a crash.
    ddp = torchrun(project, name, tmp_path / "ddp", "--peak_tflops", "100", "--activation_checkpointing", "every_other")
    printed = ddp.stdout + ddp.stderr
    assert ddp.returncode == 0 and "Traceback" not in printed, printed[-4000:]
    assert ("mfu" in trained(tmp_path / "ddp")[1][-1]) != (printed.count("MFU not reported:") == 1), printed[-4000:]
    assert trained(tmp_path / "ddp")[0], trained(tmp_path / "ddp")[1]

    fsdp = torchrun(project, name, tmp_path / "fsdp", "--strategy", "fsdp", "--activation_checkpointing", "full")
    assert fsdp.returncode == 0 and "fsdp over 2 process" in fsdp.stdout + fsdp.stderr, (fsdp.stdout + fsdp.stderr)[
        -4000:
    ]
    assert trained(tmp_path / "fsdp")[0], trained(tmp_path / "fsdp")[1]


def test_the_project_guarantees_hold_for_a_zoo_llama(zoo_projects, tmp_path):
    """The project's quick check, a plain `pytest` (the guarantees that depend on the model: 1 vs
    2 processes and accumulation, exact resume after SIGTERM, fsdp = ddp, the initial weights,
    the doctor), on the Llama (its tiny sizes are the bake's experiments/tiny.toml). Its RMSNorm
    casts to float32 but its runs agree exactly: compared at 1e-9, as the doctor judges it."""
    project, source = tmp_path / "llama", zoo_projects["language"]

    def outputs(folder, names):  # the project's demo data and runs, not ddp_utils/data/
        return {"data", "runs"} & set(names) if Path(folder) == source else set()

    shutil.copytree(source, project, ignore=outputs)
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, timeout=1500,
                 env_override=zoo_env("llama"))  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and "skipped" not in result.stdout and " passed" in result.stdout
    assert "the quick check" in result.stdout and " deselected" in result.stdout
    code = "import conftest; print(conftest.run_tolerance())"
    tolerance = run(["python", "-c", code], cwd=project / "tests", env_override=zoo_env("llama"))
    assert tolerance.stdout.split()[-1:] == ["1e-09"], tolerance.stdout + tolerance.stderr[-2000:]
