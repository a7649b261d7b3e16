"""Out of GPU memory, named (ddp_utils/train/out_of_memory.py): torch's own OutOfMemoryError, raised
by a probe in each phase of a step (tests/ddp_probe.py out_of_memory), stops the run with one
line that names the rank, the step, the phase and the knobs that help; the last checkpoint
is left as it was and the output folder let go of. Under torchrun every rank stops at once,
not when torchrun's kill comes, also where its peers wait in a collective (fsdp's clipping and
sampling)."""

import dataclasses
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import ARGS, ONE, TINY, TINY_CONFIG, TWO, run_training

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.core.units import size_text
from ddp_utils.doctor import memory as doctor_memory
from ddp_utils.errors import OutOfMemory
from ddp_utils.parallel.activation_checkpointing import checkpointable_blocks
from ddp_utils.train.folder_claim import CLAIM_FILE
from ddp_utils.train.out_of_memory import MemoryGuard, fixes, plan_settings
from task import TASK

PHASES = {
    "batch": "in the batch's move to the device",
    "forward": "in the forward",
    "backward": "in the backward",
    "clipping": "in the gradient clipping",
    "optimizer": "in the optimizer step",
    "evaluation": "in the evaluation",
    "checkpoint": "in the checkpoint",
    "compile": "in the forward of the first step (torch.compile compiling it)",
}
SAMPLING = "in the text sampling (--sample_every_steps)"  # under fsdp (test_sampling_...)


CHECKPOINTABLE = bool(checkpointable_blocks(TASK.build_model(TINY_CONFIG)))  # the knob applies to the task's model
# A doctor's memory plan, bytes per GPU under each strategy, by what they hold; its measure of
# activation checkpointing's modes.
PLANS = {"ddp": {"parameters": 1e9, "activations": 5e8}, "fsdp": {"parameters": 5e8}}
MODES = {"none": {"activations": 5e8, "recompute_flops": 0.0}, "full": {"activations": 1e8, "recompute_flops": 0.25}}


def out_of_memory_run(output_dir, phase, rank=0, step=6, nproc=1, doctor_plan=False, strategy="ddp"):
    """A run whose rank `rank` runs out of memory in `phase` of optimizer step `step`
    (checkpoints every 4 steps, a metrics line every 2, text samples every 2 when `phase` is
    sampling); returns the CompletedProcess. With `doctor_plan`, output_dir holds a doctor.json
    made for these settings (PLANS) beforehand."""
    args = [*ARGS, *(TWO if nproc == 2 else ONE), "--eval_every_steps", "2", "--strategy", strategy]
    args += ["--compile", "true"] if phase == "compile" else []
    args += ["--sample_every_steps", "2"] if phase == "sampling" else []
    if doctor_plan:
        output_dir.mkdir(parents=True)
        settings = plan_settings(parse_config(Config, [*TINY, *args], resolve=False))
        report = {"memory_bytes_per_gpu": PLANS, "configured": "ddp", "activation_checkpointing": MODES,
                  "world_size": nproc, "settings": settings}  # fmt: skip
        (output_dir / "doctor.json").write_text(json.dumps(report))
    env = {"OOM_PHASE": phase, "OOM_RANK": str(rank), "OOM_STEP": str(1 if phase == "compile" else step)}
    return run_training(output_dir, *args, nproc=nproc, probe="out_of_memory", env=env, check=False)


def assert_named_and_nothing_lost(result, output_dir, phase, rank, step, strategy="ddp"):
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    lines = [line for line in output.splitlines() if "ran out of" in line and "memory" in line]
    assert len(lines) == 1, output
    where = SAMPLING if phase == "sampling" else PHASES[phase]
    assert f"rank {rank} ran out of" in lines[0] and f"at step {step}, {where}" in lines[0], lines[0]
    knobs = lines[0].split("to fit: ")[1]
    first = (
        "--activation_checkpointing full" if checkpointable_blocks(TASK.build_model(TINY_CONFIG)) else "--batch_size"
    )
    assert knobs.startswith(first), lines[0]  # it is off: first, the one knob that changes no setting of the run
    for knob in ("--grad_accum_steps", "--amp bf16", *(["--strategy fsdp"] if strategy == "ddp" else [])):
        assert knob in knobs, lines[0]
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


@pytest.mark.parametrize("phase", [phase for phase in PHASES if phase != "clipping"])  # clipping: under fsdp, below
def test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps(phase, tmp_path):
    step = 1 if phase == "compile" else 6
    result = out_of_memory_run(tmp_path / "run", phase, step=step, doctor_plan=phase == "forward")
    line = assert_named_and_nothing_lost(result, tmp_path / "run", phase, 0, step)
    if phase == "forward":  # the doctor's plan for these settings is named, in the sizes of every line
        ddp, fsdp = (size_text(sum(PLANS[strategy].values())) for strategy in ("ddp", "fsdp"))
        assert f"the doctor's plan at these settings: ddp {ddp}, fsdp {fsdp} per GPU" in line, line
        if CHECKPOINTABLE:  # and what checkpointing saves, as it measured
            saves = f"activations {size_text(5e8)} -> {size_text(1e8)} per GPU, +25% FLOPs"
            assert f"to fit: --activation_checkpointing full (the doctor's figure: {saves})" in line, line


def test_one_rank_out_of_memory_stops_every_rank_at_once(tmp_path):
    """Rank 1 runs out of memory in its backward; rank 0 waits for it in the gradients'
    all-reduce, where torchrun's stop signal does not reach it: it leaves as soon as rank 1
    has said why (its heartbeat thread sees it in the store), not when torchrun kills it."""
    result = out_of_memory_run(tmp_path / "run", "backward", rank=1, nproc=2)
    assert_named_and_nothing_lost(result, tmp_path / "run", "backward", 1, 6)
    assert "exitcode: -9" not in result.stderr, result.stderr  # no worker left to torchrun's SIGKILL


@pytest.mark.parametrize("phase", ["clipping", "sampling"])
def test_out_of_memory_in_fsdps_clipping_and_sampling_stops_every_rank_at_once(phase, tmp_path):
    """Under fsdp rank 1 runs out of memory where rank 0 goes on into a collective with it: the
    gradient norm's all-reduce (clipping), a forward's all-gathers (sampling: every rank samples,
    and the task's sample_text, or the probe's where it has none, calls a collective). Every
    rank stops with the one line, none left to torchrun's SIGKILL: not a hang, nor sampling
    turned off on rank 1 alone (its next all-gathers out of step with rank 0's)."""
    result = out_of_memory_run(tmp_path / "run", phase, rank=1, step=2, nproc=2, strategy="fsdp")
    assert_named_and_nothing_lost(result, tmp_path / "run", phase, 1, 2, strategy="fsdp")
    assert "exitcode: -9" not in result.stderr, result.stderr


def test_the_smaller_batch_named_keeps_the_global_batch():
    """--batch_size N --grad_accum_steps A: the knob named, here and in the doctor's memory plan
    row, trains N x A samples a step as before, also where N is odd (5: 1 x 5, not 2 x 2) or
    accumulates already; at --batch_size 1 none."""
    plan = {"ddp": {"parameters": 2**30, "activations": 4 * 2**30}}  # activations too many for 2 GiB
    for batch_size, accum in [(64, 1), (6, 3), (5, 1), (9, 2), (7, 4)]:
        cfg = parse_config(Config, [*TINY, "--batch_size", str(batch_size), "--grad_accum_steps", str(accum)],
                           resolve=False)  # fmt: skip
        doctors = doctor_memory.memory_check(plan, {"ddp": "--strategy ddp"}, "ddp", cfg, 2, 1)["fix"]
        for line in (fixes(cfg), doctors):
            named = re.search(r"--batch_size (\d+) --grad_accum_steps (\d+)", line)
            assert named, line
            smaller, more = int(named[1]), int(named[2])
            assert smaller < batch_size and smaller * more == batch_size * accum, line
        assert f"{named[0]} (the same global batch)" in fixes(cfg)
    assert "--batch_size" not in fixes(parse_config(Config, [*TINY, "--batch_size", "1"], resolve=False))


def test_only_the_first_forward_under_compile_is_blamed_on_the_compile():
    """--compile: the first forward of a start compiles; one out of memory later (the first
    step's next micro-batch, a later step) is the forward's, as without --compile."""
    cfg = parse_config(Config, [*TINY, "--compile", "true", "--grad_accum_steps", "2"], resolve=False)
    guard = MemoryGuard(cfg, SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1))

    def line(step):
        with pytest.raises(OutOfMemory) as raised, guard.during("forward", step):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return str(raised.value)

    assert "at step 1, in the forward of the first step (torch.compile compiling it)" in line(1)
    assert "at step 1, in the forward;" in line(1)  # its second micro-batch
    assert "at step 2, in the forward;" in line(2)


def test_cpu_offload_is_named_where_the_sharded_state_itself_does_not_fit():
    """Under fsdp with the other knobs turned: --cpu_offload where the doctor's sharded state per
    GPU is more than the GPU holds (or, without the doctor's figure, as what is left), not where
    it fits; never under ddp, whose state it cannot move."""
    flags = ["--strategy", "fsdp", "--amp", "bf16", "--batch_size", "1", "--activation_checkpointing", "full"]
    cfg = parse_config(Config, [*TINY, *flags], resolve=False)
    state = {"parameters": 3 * 2**30, "gradients": 3 * 2**30, "optimizer": 6 * 2**30}
    report = {"memory_bytes_per_gpu": {"fsdp": {**state, "activations": 2**30}}, "configured": "fsdp"}
    named = "--cpu_offload (the sharded state, 12.0 GiB per GPU, does not fit the GPU)"
    assert fixes(cfg, report, gpu=10 * 2**30) == named
    assert fixes(cfg, report, gpu=40 * 2**30) == "more GPUs with --strategy fsdp"
    assert fixes(cfg) == "--cpu_offload"
    assert "--cpu_offload" not in fixes(dataclasses.replace(cfg, strategy="ddp"), report, gpu=10 * 2**30)
    assert fixes(dataclasses.replace(cfg, cpu_offload=True), report, gpu=10 * 2**30) == "more GPUs with --strategy fsdp"
