"""The preflight's measurements once the process has joined: a collective under a timeout,
all-reduce bandwidth, the network NCCL picks, and how fast the checkpoint folder takes a
checkpoint against the stop notice."""

import math
import os
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.space import existing
from ..core.units import size_text
from ..distributed.faults import stop_notice
from ..errors import PreflightError
from .comm_model import (
    bus_bandwidth,
)
from .local_checks import say

# Sizes past one all-reduce this long are not measured: on a slow link 256 MiB takes minutes,
# and the larger sizes add nothing (the time per byte is already the link's).
SIZE_STOP_SECONDS = 1.0


# A checkpoint's write is timed on at most this much of it per rank, then scaled up: enough for
# a file system's steady speed, without minutes of writing a large model's on a slow one.
WRITE_SAMPLE_BYTES = 256 * 2**20


def check_collective(ctx):
    value = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
    started = time.perf_counter()
    dist.all_reduce(value)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    if value.item() != expected:
        raise PreflightError(f"all-reduce returned {value.item()}, expected {expected}")
    return f"all-reduce of {ctx.world_size} ranks correct in {1000 * (time.perf_counter() - started):.1f} ms"


def measure_allreduce(ctx, sizes_mib, group=None, iterations=3):
    """Rows of (size in MiB, seconds per all-reduce, algbw GB/s, busbw GB/s) over `group`
    (default: all processes), every rank agreeing; stops after the first size slower than
    SIZE_STOP_SECONDS. The bandwidths are rates as nccl-tests defines them: the bytes over the
    seconds, in GB/s of 1e9 bytes a second (binary sizes, decimal rates: as nccl-tests prints)."""
    rows = []
    world_size = dist.get_world_size(group)
    for size_mib in sizes_mib:
        tensor = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32, device=ctx.device)
        dist.all_reduce(tensor, group=group)  # warm-up: connections, buffers
        synchronize(ctx)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor, group=group)
        synchronize(ctx)
        (seconds,) = slowest(ctx, (time.perf_counter() - started) / iterations)
        algbw = size_mib * 2**20 / seconds / 1e9
        rows.append((size_mib, seconds, algbw, bus_bandwidth(algbw, world_size)))
        if seconds > SIZE_STOP_SECONDS:  # the same decision on every rank: `seconds` is agreed
            break
    return rows


def time_checkpoint_write(ctx, folder, nbytes):
    """Seconds this job takes to write and fsync a checkpoint into `folder`: each rank its own
    `nbytes` (0: it writes none) into a temporary file it removes, all ranks at once as in a
    save (at most WRITE_SAMPLE_BYTES each, the time scaled up to `nbytes`). The slowest rank's,
    on every rank; inf where a rank could not write (it says why)."""
    sample = min(nbytes, WRITE_SAMPLE_BYTES)
    slowest(ctx, 0.0)  # every rank starts together: they share the file system as in a save
    seconds = 0.0
    if sample:
        path = existing(folder) / f".preflight-write-{ctx.rank}.tmp"
        chunk = os.urandom(min(sample, 2**20))  # not zeros, which a file system may compress or skip
        started = time.perf_counter()
        try:
            with open(path, "wb") as out:
                for start in range(0, sample, len(chunk)):
                    out.write(chunk[: sample - start])
                out.flush()
                os.fsync(out.fileno())
            seconds = (time.perf_counter() - started) * nbytes / sample
        except OSError as error:
            say(ctx.rank, f"PROBLEM: could not write a test file of {size_text(sample)} into {path.parent}: {error}")
            seconds = math.inf
        finally:
            path.unlink(missing_ok=True)
    (seconds,) = slowest(ctx, seconds)
    return seconds


def notice_knob(seconds, environ=os.environ):
    """Where to give the workers `seconds` after a stop signal, for the launcher in use."""
    if "SLURM_JOB_ID" in environ:  # scripts/slurm.sbatch sets STOP_GRACE_SECONDS from this line
        return f"the line #SBATCH --signal=B:USR1@{seconds} of the sbatch script"
    if "KUBERNETES_SERVICE_HOST" in environ:
        return f"the pods' terminationGracePeriodSeconds: {seconds} and their STOP_GRACE_SECONDS {seconds}"
    return (
        f"STOP_GRACE_SECONDS={seconds} for scripts/launch.sh; under SLURM the line #SBATCH --signal=B:USR1@{seconds}, "
        "on Kubernetes the pods' terminationGracePeriodSeconds and STOP_GRACE_SECONDS"
    )


def save_in_notice(write_seconds, step_seconds, cfg, environ=os.environ):
    """Whether a preemption's checkpoint is saved before the kill: the step in progress when
    the signal comes and the one in which every rank agrees to stop, then the save (under
    --async_checkpoint also the save in flight, finished first), against the seconds the
    workers get. Returns (fits, the line that says so, {numbers}). The write is what was timed;
    gathering the state and copying it off the GPU come on top."""
    notice = stop_notice(environ)
    budget, source = notice.workers_seconds, notice.source
    saves = 2 if cfg.async_checkpoint else 1
    needed = 2 * step_seconds + saves * write_seconds
    numbers = {"stop_grace_seconds": environ.get("STOP_GRACE_SECONDS"), "workers_stop_seconds": budget,
               "preemption_save_seconds": needed, "fits_notice": needed <= budget}  # fmt: skip
    what = (
        f"{saves} save{'s' if saves > 1 else ''} ({write_seconds:.3g} s each) after 2 steps ({step_seconds:.3g} s each)"
    )
    if needed <= budget:
        return (
            True,
            f"a preemption's checkpoint fits the stop notice: {what}, {needed:.3g} s of {budget} s ({source})",
            numbers,
        )
    every = cfg.checkpoint_every_steps
    fallback = f"--checkpoint_every_steps {every}" if every else "the last epoch's end (--checkpoint_every_steps 0)"
    raised = math.ceil(1.5 * needed) + 10  # half again, for a file system's bad days; 10 s for the launchers
    line = (
        f"WARNING: a preemption's checkpoint does not fit the stop notice: {what} take {needed:.3g} s, but the "
        f"workers get {budget} s after a stop signal ({source}), so they are killed mid-save and the run resumes "
        f"from its last periodic checkpoint, {fallback}. Raise the notice to {raised} s "
        f"({notice_knob(raised, environ)}), or make the checkpoint smaller"
    )
    return False, line, numbers


def slowest(ctx, *seconds):
    """Each value's largest over every rank: the slowest rank sets the pace, and every rank
    gets the same numbers to decide with."""
    values = torch.tensor(seconds, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def synchronize(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def nccl_transport(log_text):
    """The network NCCL chose, from its NCCL_DEBUG=INFO output: "IB", "Socket", a plugin's name
    ("AWS Libfabric" for EFA), with the line that names the devices; None if it did not say."""
    chosen = re.search(r"NCCL INFO Using network (.+?)\s*$", log_text, re.MULTILINE)
    if not chosen:
        return None
    network = chosen[1]
    devices = re.search(r"NCCL INFO (NET/\S+ : Using .+?)\s*$", log_text, re.MULTILINE)
    text = f"{network} ({devices[1]})" if devices else network
    if "GDRDMA" in log_text:
        text += ", GPUDirect RDMA"
    if network == "Socket":
        text += ": TCP, no InfiniBand/RoCE or EFA in use (the job has no RDMA device NCCL can use)"
    return text


def log_nccl_network():
    """Have NCCL say which network it picks (NCCL_DEBUG=INFO, its INIT and NET lines) into a file
    of this process's, set before NCCL starts; returns the file. None when the user set
    NCCL_DEBUG: their output goes where they asked (its "Using network" line says it)."""
    if "NCCL_DEBUG" in os.environ:
        return None
    path = Path(tempfile.gettempdir()) / f"preflight-nccl-{os.getpid()}.log"
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
    return path


def read_nccl_network(path):
    """The network NCCL chose, from the file log_nccl_network set up (then removed)."""
    if path is None:
        return "see NCCL's own output (NCCL_DEBUG is set): its 'Using network' line"
    try:
        text = Path(path).read_text(errors="replace")
        Path(path).unlink()
    except OSError as error:
        return f"not known ({error})"
    return nccl_transport(text) or "not said in NCCL's INFO lines"
