"""CUDA out of memory, named: torch's OutOfMemoryError caught where it happens (the forward, the
first step's torch.compile, the backward, the optimizer step, evaluation) and turned into one
line: the rank, the step, the phase, the memory in use and the GPU's total, the doctor's plan
for this model at these settings when doctor.json has one, and the knobs that make it fit. Every
size in it is in binary units (core.units: MiB, GiB), the plan's as the GPU's.
The run stops on every rank (errors.OutOfMemory: the first rank out of memory says it, the
others leave), its last checkpoint untouched and its output folder let go of."""

import contextlib
import json
from pathlib import Path

import torch

from ..core.units import size_text
from ..errors import OutOfMemory


class MemoryGuard:
    """`during(phase, step)` turns an out-of-memory error inside into OutOfMemory's line."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.forwards = 0  # training forwards of this start: the first one compiles (--compile)

    @contextlib.contextmanager
    def during(self, phase, step):
        if phase == "forward":
            self.forwards += 1
            if self.cfg.compile and self.forwards == 1:
                phase = "forward of the first step (torch.compile compiling it)"
        try:
            yield
        except torch.OutOfMemoryError:
            raise OutOfMemory(out_of_memory_line(self.cfg, self.ctx, step, phase)) from None


def out_of_memory_line(cfg, ctx, step, phase):
    device = ctx.device
    where = f"rank {ctx.rank} ran out of {device.type.upper()} memory at step {step}, in the {phase}"
    return "; ".join(filter(None, [where, memory_in_use(device), doctor_plan(cfg, ctx), "to fit: " + fixes(cfg)]))


def memory_in_use(device):
    """What torch holds on the GPU, and the GPU's total (None off CUDA)."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    except RuntimeError:  # the CUDA context itself is what failed
        return None
    return (
        f"{size_text(allocated)} in tensors, {size_text(reserved)} reserved by torch, {size_text(free)} free of the "
        f"GPU's {size_text(total)}"
    )


def doctor_plan(cfg, ctx):
    """The doctor's memory plan (output_dir/doctor.json), when it was made for these settings."""
    try:
        report = json.loads((Path(cfg.output_dir) / "doctor.json").read_text())
        settings, plans = report["settings"], report["memory_bytes_per_gpu"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if settings != plan_settings(cfg) or report.get("world_size") != ctx.world_size:
        return None
    totals = ", ".join(f"{name} {size_text(sum(parts.values()))}" for name, parts in plans.items())
    return f"the doctor's plan at these settings: {totals} per GPU (doctor.json)"


def plan_settings(cfg):
    """The settings a memory plan depends on (written to doctor.json by the doctor)."""
    return {
        "batch_size": cfg.batch_size,
        "amp": cfg.amp,
        "strategy": cfg.strategy,
        "activation_checkpointing": cfg.activation_checkpointing,
    }


def fixes(cfg):
    """The knobs that lower the memory a step needs, those not turned already."""
    knobs = []
    if cfg.batch_size > 1:
        knobs.append(
            f"--batch_size {cfg.batch_size // 2} --grad_accum_steps {2 * cfg.grad_accum_steps} (the same global batch)"
        )
    if cfg.activation_checkpointing == "none":
        knobs.append("--activation_checkpointing full")
    if cfg.strategy == "ddp":
        knobs.append("--strategy fsdp")
    if cfg.amp != "bf16":
        knobs.append("--amp bf16")
    return ", ".join(knobs) or "more GPUs with --strategy fsdp"
