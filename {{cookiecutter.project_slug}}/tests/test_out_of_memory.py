"""Out of GPU memory, named (ddp_utils/train/out_of_memory.py): torch's own OutOfMemoryError, raised
by a probe in each phase of a step (tests/ddp_probe.py out_of_memory), stops the run with one
line that names the rank, the step, the phase and the knobs that help; the last checkpoint
is left as it was and the output folder let go of. Under torchrun every rank stops at once,
not when torchrun's kill comes."""

import json
import os

import pytest
from conftest import ARGS, ONE, TINY, TWO, run_training

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.core.units import size_text
from ddp_utils.train.folder_claim import CLAIM_FILE
from ddp_utils.train.out_of_memory import plan_settings

PHASES = {
    "forward": "in the forward",
    "backward": "in the backward",
    "optimizer": "in the optimizer step",
    "evaluation": "in the evaluation",
    "compile": "in the forward of the first step (torch.compile compiling it)",
}


# A doctor's memory plan, bytes per GPU under each strategy, by what they hold.
PLANS = {"ddp": {"parameters": 1e9, "activations": 5e8}, "fsdp": {"parameters": 5e8}}


def out_of_memory_run(output_dir, phase, rank=0, step=6, nproc=1, doctor_plan=False):
    """A run whose rank `rank` runs out of memory in `phase` of optimizer step `step`
    (checkpoints every 4 steps, a metrics line every 2); returns the CompletedProcess. With
    `doctor_plan`, output_dir holds a doctor.json made for these settings (PLANS) beforehand."""
    args = [*ARGS, *(TWO if nproc == 2 else ONE), "--eval_every_steps", "2"]
    args += ["--compile", "true"] if phase == "compile" else []
    if doctor_plan:
        output_dir.mkdir(parents=True)
        report = {"memory_bytes_per_gpu": PLANS, "world_size": nproc,
                  "settings": plan_settings(parse_config(Config, [*TINY, *args], resolve=False))}  # fmt: skip
        (output_dir / "doctor.json").write_text(json.dumps(report))
    env = {"OOM_PHASE": phase, "OOM_RANK": str(rank), "OOM_STEP": str(1 if phase == "compile" else step)}
    return run_training(output_dir, *args, nproc=nproc, probe="out_of_memory", env=env, check=False)


def assert_named_and_nothing_lost(result, output_dir, phase, rank, step):
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    lines = [line for line in output.splitlines() if "ran out of" in line and "memory" in line]
    assert len(lines) == 1, output
    assert f"rank {rank} ran out of" in lines[0] and f"at step {step}, {PHASES[phase]}" in lines[0], lines[0]
    for knob in ("--grad_accum_steps", "--strategy fsdp", "--amp bf16"):
        assert knob in lines[0], lines[0]
    assert [line for line in output.splitlines() if "] ERROR" in line] == lines, output  # no rank's traceback
    checkpoints = output_dir / "checkpoints"
    if step > 4:  # the checkpoint of step 4 is still the last one, and nothing half-written is left
        assert sorted(path.name for path in checkpoints.iterdir()) == [
            "last.pt",
            "step_000000002.pt",
            "step_000000004.pt",
        ], list(checkpoints.iterdir())
        assert os.path.samefile(checkpoints / "last.pt", checkpoints / "step_000000004.pt")
    assert not (output_dir / CLAIM_FILE).exists(), "the output folder was not let go of"
    return lines[0]


@pytest.mark.parametrize("phase", PHASES)
def test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps(phase, tmp_path):
    step = 1 if phase == "compile" else 6
    result = out_of_memory_run(tmp_path / "run", phase, step=step, doctor_plan=phase == "forward")
    line = assert_named_and_nothing_lost(result, tmp_path / "run", phase, 0, step)
    if phase == "forward":  # the doctor's plan for these settings is named, in the sizes of every line
        ddp, fsdp = (size_text(sum(PLANS[strategy].values())) for strategy in ("ddp", "fsdp"))
        assert f"the doctor's plan at these settings: ddp {ddp}, fsdp {fsdp} per GPU" in line, line


def test_one_rank_out_of_memory_stops_every_rank_at_once(tmp_path):
    """Rank 1 runs out of memory in its backward; rank 0 waits for it in the gradients'
    all-reduce, where torchrun's stop signal does not reach it: it leaves as soon as rank 1
    has said why (its heartbeat thread sees it in the store), not when torchrun kills it."""
    result = out_of_memory_run(tmp_path / "run", "backward", rank=1, nproc=2)
    assert_named_and_nothing_lost(result, tmp_path / "run", "backward", 1, 6)
    assert "exitcode: -9" not in result.stderr, result.stderr  # no worker left to torchrun's SIGKILL
