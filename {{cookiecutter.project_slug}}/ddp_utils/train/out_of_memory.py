"""CUDA out of memory, named: torch's OutOfMemoryError caught where it happens (the batch's move
to the device, the forward, the first step's torch.compile, the backward, the gradients'
unscaling and clipping, the optimizer step, evaluation, a checkpoint's gathers and DCP's
staging, --sample_every_steps' sampling) and turned into one line: the rank, the step, the
phase, the memory in use and the GPU's total, the doctor's plan for this model at these
settings when doctor.json has one, and the knobs that make it fit: --activation_checkpointing
first while it is off (with the doctor's figure of what it saves), a smaller --batch_size with
more --grad_accum_steps (the same global batch), --cpu_offload under fsdp where the sharded
state itself does not fit. Every size in it is in binary units (core.units: MiB, GiB), the
plan's as the GPU's.
The run stops on every rank (errors.OutOfMemory: the first rank out of memory says it, the
others leave, wherever they wait for it: in a collective too), its last checkpoint untouched
and its output folder let go of. Never caught as any other error and gone on from on one rank
alone: the ranks' collectives would fall out of step."""

import contextlib
import json
from pathlib import Path

import torch

from ..core.units import size_text
from ..errors import OutOfMemory


class MemoryGuard:
    """`during(phase, step)` turns an out-of-memory error inside into OutOfMemory's line;
    `checkpointable`: the model has blocks --activation_checkpointing can recompute."""

    def __init__(self, cfg, ctx, checkpointable=True):
        self.cfg, self.ctx, self.checkpointable = cfg, ctx, checkpointable
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
            raise OutOfMemory(out_of_memory_line(self.cfg, self.ctx, step, phase, self.checkpointable)) from None


def out_of_memory_line(cfg, ctx, step, phase, checkpointable=True):
    device = ctx.device
    where = f"rank {ctx.rank} ran out of {device.type.upper()} memory at step {step}, in the {phase}"
    report = doctor_report(cfg, ctx)
    knobs = "to fit: " + fixes(cfg, report, gpu_bytes(device), checkpointable)
    return "; ".join(filter(None, [where, memory_in_use(device), doctor_plan(report), knobs]))


def gpu_bytes(device):
    """The GPU's memory in bytes (None off CUDA, or when CUDA itself is what failed)."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.mem_get_info(device)[1]
    except RuntimeError:
        return None


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


def doctor_report(cfg, ctx):
    """The doctor's report (output_dir/doctor.json), when it was made for these settings."""
    try:
        report = json.loads((Path(cfg.output_dir) / "doctor.json").read_text())
        if report["settings"] == plan_settings(cfg) and report["world_size"] == ctx.world_size:
            return report
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def doctor_plan(report):
    """The doctor's memory plan per GPU under each strategy, from its report."""
    try:
        plans = report["memory_bytes_per_gpu"]
        totals = ", ".join(f"{name} {size_text(sum(parts.values()))}" for name, parts in plans.items())
    except (KeyError, TypeError, AttributeError):
        return None
    return f"the doctor's plan at these settings: {totals} per GPU (doctor.json)"


def plan_settings(cfg):
    """The settings a memory plan depends on (written to doctor.json by the doctor)."""
    return {
        "batch_size": cfg.batch_size,
        "amp": cfg.amp,
        "strategy": cfg.strategy,
        "activation_checkpointing": cfg.activation_checkpointing,
        "cpu_offload": cfg.cpu_offload,
    }


def fixes(cfg, report=None, gpu=None, checkpointable=True):
    """The knobs that lower the memory a step needs, those not turned already, with the doctor's
    figures where its `report` has them; `gpu`: the GPU's bytes, where known."""
    knobs = []
    if cfg.activation_checkpointing == "none" and checkpointable:  # first: it trades no setting, only time
        knobs.append("--activation_checkpointing full" + checkpointing_saves(report))
    if smaller := same_global_batch(cfg):
        knobs.append(f"{smaller} (the same global batch)")
    if cfg.strategy == "ddp":
        knobs.append("--strategy fsdp")
    if cfg.amp != "bf16":
        knobs.append("--amp bf16")
    if cfg.strategy == "fsdp" and not cfg.cpu_offload:
        state = sharded_state(report)
        if state is not None and gpu is not None:  # the doctor's figure against this GPU
            if state > 0.9 * gpu:
                knobs.append(f"--cpu_offload (the sharded state, {size_text(state)} per GPU, does not fit the GPU)")
        elif not knobs:  # nothing else left to turn
            knobs.append("--cpu_offload")
    return ", ".join(knobs) or "more GPUs with --strategy fsdp"


def same_global_batch(cfg):
    """A smaller micro-batch and more accumulation steps with the global batch of now (their
    product kept: 64 -> 32 x 2, 6 -> 3 x 2, 5 -> 1 x 5), by --batch_size's smallest factor; None at
    --batch_size 1, where no smaller one is left."""
    factor = next((f for f in range(2, cfg.batch_size + 1) if cfg.batch_size % f == 0), None)
    if factor is None:
        return None
    return f"--batch_size {cfg.batch_size // factor} --grad_accum_steps {factor * cfg.grad_accum_steps}"


def checkpointing_saves(report):
    """What --activation_checkpointing full saves, as the doctor measured it ("" without its report)."""
    try:
        none, full = report["activation_checkpointing"]["none"], report["activation_checkpointing"]["full"]
        before, after, cost = none["activations"], full["activations"], full["recompute_flops"]
    except (KeyError, TypeError):
        return ""
    return f" (the doctor's figure: activations {size_text(before)} -> {size_text(after)} per GPU, +{cost:.0%} FLOPs)"


def sharded_state(report):
    """The configured strategy's parameters, gradients and optimizer state per GPU in the doctor's plan."""
    try:
        plan = report["memory_bytes_per_gpu"][report["configured"]]
        return plan["parameters"] + plan["gradients"] + plan["optimizer"]
    except (KeyError, TypeError):
        return None
