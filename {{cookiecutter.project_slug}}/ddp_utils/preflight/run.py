"""The preflight: check a cluster before a long job, under the same launcher as training.

    scripts/launch.sh --preflight [--json] [train.py flags]   # every node, as for training
    torchrun --standalone --nproc_per_node=2 preflight.py [--json]

Each process checks its place in the job, its GPUs and its network identity *before*
joining the process group (a bad hostname makes gloo or NCCL hang, not fail; two processes
on one GPU make NCCL fail with "Duplicate GPU detected"). Then all
processes run a collective under a timeout and measure all-reduce bandwidth from 1 MiB to
256 MiB. Rank 0 prints a table and a verdict: the estimated all-reduce time of this model's
gradients per step against the measured compute time of a step, so you see before the job
whether more nodes will train faster. Train flags (--hidden_dim, --batch_size, ...) size the
model as for training. Exit status: 0 all good, 1 a problem was found.

The prediction: training steps are timed as training runs them, with and without the
gradients' all-reduce, the two kinds in turns (step_times); the synced step is the job's, and
the difference is what communication costs as DDP runs it (bucketed, overlapped with
backward, with the library's overheads: on CPU gloo these are a good part of it, more than
the bytes on a fast link). Under --strategy fsdp, which communicates all through a step, the
step without communication is one process's alone, in a process group of its own
(compute_alone_seconds). One node all-reduces over its own links only (nothing, with one
process per node). Each comm hook sends other bytes (bf16: half; powersgd: two thin matrices
per weight matrix): its step differs by the all-reduce time of those bytes at the measured
bandwidth, and the verdict names the hook that pays most when the configured one does not.
`--json` prints all of it as one object on rank 0 (stdout; the per-rank lines go to stderr).
Sizes are in binary units (core.units: MiB, GiB); the bandwidths are rates, nccl-tests' algbw
and busbw in its GB/s (1e9 bytes a second).

The checkpoint folder: its free space against what the kept checkpoints of this job take at
their peak (checkpoint_space; a shortfall is a problem), and how fast it takes a checkpoint
(each rank that writes one writes and fsyncs a temporary file of its share at once), against
the stop notice the launcher gives (STOP_GRACE_SECONDS): a preemption's checkpoint that would
not fit is a warning, with the knob to raise the notice.
"""

import contextlib
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..configuration import parse_config
from ..core.collector import Collector
from ..core.units import size_text
from ..data.loaders import start_epoch
from ..distributed.device import choose_device
from ..distributed.process_group import (
    DistContext,
    cleanup_distributed,
    process_env,
    processes_per_node,
    setup_distributed,
)
from ..errors import InputError, PreflightError
from ..parallel.comm_hooks import COMM_HOOKS
from ..train.inputs import check_inputs
from ..train.trainer import Trainer
from .comm_model import (
    gradient_bytes,
    hook_advice,
    internode_bytes,
    predict,
    verdict,
)
from .local_checks import check_data_store, check_gpus, check_network_identity, check_own_gpu, check_place, say
from .measure import (
    check_collective,
    log_nccl_network,
    measure_allreduce,
    read_nccl_network,
    save_in_notice,
    slowest,
    synchronize,
    time_checkpoint_write,
)

# The all-reduce sizes measured, in MiB (2**20 bytes); PREFLIGHT_MAX_MB, in MiB too, leaves out the larger.
SIZES_MIB = (1, 4, 16, 64, 256)
# Steps are timed over at least this long (and at least MIN_REPEATS of them): 5 steps of 60 ms
# are a 0.3 s sample of a shared machine's speed, which stalls for longer than that.
TIMED_SECONDS = 1.0
MIN_REPEATS, MAX_REPEATS = 5, 25


def step_seconds(task, cfg, ctx, compute=None):
    """The job's optimizer step, timed as training runs it (step_times): the same Trainer
    (model, amp, TF32, compile), micro-batches of the training data, the optimizer step, the
    gradients' communication as the job will run it (its overlap with backward, the buckets,
    the library's overheads included). Under ddp also the compute alone: the same steps with
    the gradients' all-reduce skipped (DDP's no_sync). Under fsdp `compute` is that, timed
    before (compute_alone_seconds; None: not timed).

    Returns (compute seconds or None, synced seconds, {comm hook: bytes all-reduced per step},
    {strategy: bytes each node sends to other nodes per step}): the slowest rank's, so every
    rank agrees; and this rank's (checkpoint_space.Space, bytes it writes of a checkpoint),
    with the optimizer's state as the steps left it.
    """
    datasets, _ = check_inputs(task, cfg, ctx)  # bad data: an InputError, a PROBLEM line
    trainer = Trainer(cfg, ctx, task, datasets)
    fsdp = cfg.strategy == "fsdp"
    try:
        seconds = step_times(ctx, trainer, (True,) if fsdp else (False, True))
        trainer.read_agreement()  # the last step's agreement, in flight
        compute = seconds.get(False, compute)
        unknown, compute, synced = slowest(ctx, float(compute is None), compute or 0.0, seconds[True])
        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        hooks = ("none",) if fsdp else COMM_HOOKS  # the comm hooks are DDP's
        sent = {hook: gradient_bytes(parameters, hook) for hook in hooks}
        crossing = internode_bytes(parameters, cfg, ctx.world_size, ctx.nodes, sent, dist.get_backend())
        checkpoints = trainer.checkpointer.space(trainer.state_dict(), trainer.loss_totals)
    finally:
        trainer.close("finished")  # no tracker runs were opened
    return None if unknown else compute, synced, sent, crossing, checkpoints


def step_times(ctx, trainer, kinds, warmup=2, runs=3):
    """{sync: seconds an optimizer step takes} for each kind of step in `kinds` (True: with the
    gradients' all-reduce, on the last micro-step as in training; False: without, DDP's
    no_sync), as the training loop runs steps: one after another, each micro-step on the
    training loader's next batch, the host waiting for the device only at the end of a run.

    A kind's time is the median of `runs` runs of consecutive steps, the kinds taking turns
    run by run, so that a slow spell of a shared machine falls on both alike; a run's time is
    its total over its steps, as the job's throughput counts them. All runs of a kind together
    hold TIMED_SECONDS of steps or MIN_REPEATS steps, whichever is more (at most MAX_REPEATS),
    after `warmup` steps of each kind (the first compile and tune kernels; DDP orders its
    buckets after its first synced step).
    """
    accum = trainer.cfg.grad_accum_steps
    batches = training_batches(trainer)

    def run(sync, steps):
        synchronize(ctx)
        started = time.perf_counter()
        for _ in range(steps):
            for micro_step in range(accum):
                trainer.train_step(next(batches), sync=sync and micro_step == accum - 1)
            trainer.optimizer_step()
        synchronize(ctx)
        return (time.perf_counter() - started) / steps

    trainer.model.train()
    warm = []
    for sync in kinds:
        run(sync, warmup - 1)
        warm.append(run(sync, 1))
    steps = math.ceil(agreed_repeats(ctx, max(warm)) / runs)
    times = {sync: [] for sync in kinds}
    with start_up_garbage_frozen():
        for _ in range(runs):
            for sync in kinds:
                times[sync].append(run(sync, steps))
    return {sync: sorted(seconds)[runs // 2] for sync, seconds in times.items()}


@contextlib.contextmanager
def start_up_garbage_frozen():
    """Start-up's garbage collected, and no full collection while steps are timed, as in
    training (collector.py). Else its first full collection after start-up (the 10^6 objects
    that importing torch and building DDP leave: 0.2-0.4 s on this CPU) falls on whichever step
    the allocation counts decide, inside a timed run or not."""
    collector = Collector()
    collector.start()
    try:
        yield
    finally:
        collector.close()  # cleanup_distributed's collection must reach DDP's reducer (its cycles)


def training_batches(trainer):
    """The training loader's batches, epoch after epoch, as the training loop draws them."""
    for epoch in itertools.count():
        start_epoch(trainer.train_loader, epoch, trainer.ctx.rank, trainer.cfg.seed)
        yield from trainer.train_loader


def compute_alone_seconds(task, cfg, env):
    """Under fsdp: the compute of an optimizer step, timed before this process joins the job;
    returns (seconds, line).

    DDP's no_sync leaves the gradients' all-reduce out of a step, but FSDP communicates all
    through one: each block's parameters are all-gathered in forward (and backward), the
    gradients reduce-scattered on every micro-step. So the step is timed as this process runs it
    alone, in a process group of its own, where FSDP moves nothing over any link. Its optimizer
    updates the whole model where each of the job's updates its shard: the compute is a little
    overestimated where the optimizer step is a large part of the step. Seconds None: not timed,
    when the whole model does not fit one GPU (the memory FSDP saves), or the data cannot be
    read (the job's own check then says why, on every rank).
    """
    device = choose_device(env["LOCAL_RANK"], cfg.device)
    try:
        datasets = task.build_datasets(cfg)
    except (InputError, OSError):
        return None, "compute alone not timed: the data cannot be read"
    alone_cfg = dataclasses.replace(cfg, replicate_degree=1)  # one process: plain FSDP
    with process_group_of_one(device, cfg.timeout_seconds, cfg.cpu_offload) as alone:
        try:
            trainer = Trainer(alone_cfg, alone, task, datasets)
            try:
                seconds = step_times(alone, trainer, (True,))[True]
                trainer.read_agreement()
            finally:
                trainer.close("finished")
        except torch.OutOfMemoryError:
            return None, "compute alone not timed: the whole model does not fit one GPU"
    return seconds, f"compute alone (fsdp over this process only): {1000 * seconds:.2f} ms a step"


@contextlib.contextmanager
def process_group_of_one(device, timeout_seconds, host_collectives=False):
    """This process as the only one of a process group (an in-memory store), on `device`: the
    DistContext of a job of one process (on GPUs with CPU collectives too for --cpu_offload, as
    setup_distributed makes it)."""
    store = dist.HashStore()
    device_id = device if device.type == "cuda" else None
    backend = "gloo"
    if device_id is not None:
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_seconds), device_id=device_id)  # fmt: skip
    try:
        yield DistContext(0, 0, 1, device, store)
    finally:
        cleanup_distributed()
        if device_id is not None:
            torch.cuda.empty_cache()  # what an out-of-memory step left


def agreed_repeats(ctx, warm_step_seconds):
    """How many steps to time after a warm-up step this long: the same on every rank (each
    synced step is a collective), from the slowest rank's warm-up step."""
    (seconds,) = slowest(ctx, warm_step_seconds)
    return min(max(MIN_REPEATS, math.ceil(TIMED_SECONDS / max(seconds, 1e-6))), MAX_REPEATS)


def main(task, argv=None):
    """The preflight of `task` (contract.Task) with the flags in `argv`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv  # preflight's own flag; the rest are train.py's
    argv = [arg for arg in argv if arg != "--json"]
    cfg = parse_config(task.config, argv)
    env = process_env()
    rank = env["RANK"]
    lines = sys.stderr if as_json else sys.stdout  # --json: stdout holds the object alone
    store = None  # check_own_gpu's, kept until the process group has its own
    try:
        say(rank, check_place(env), lines)
        say(rank, check_gpus(env, cfg.device), lines)
        say(rank, check_network_identity(), lines)
        source = getattr(cfg, "data_dir", "") or getattr(cfg, "data_file", "")  # the tabular task's is --data_file
        data_line = check_data_store(source, env["LOCAL_RANK"]) if source else None
        if data_line:
            say(rank, data_line, lines)
        device = choose_device(env["LOCAL_RANK"], cfg.device)
        if device.type == "cuda" and processes_per_node() > 1:
            line, store = check_own_gpu(env, device, cfg.timeout_seconds)
            say(rank, line, lines)
    except PreflightError as problem:
        say(rank, f"PROBLEM: {problem}", lines)
        return 1
    nccl_log = log_nccl_network() if device.type == "cuda" else None
    compute_alone = None
    if cfg.strategy == "fsdp":
        compute_alone, line = compute_alone_seconds(task, cfg, env)
        say(rank, line, lines)
    ctx = setup_distributed(cfg.timeout_seconds, device=cfg.device, host_collectives=cfg.cpu_offload)
    del store  # the process group has a store of its own now
    try:
        say(rank, check_collective(ctx), lines)
        if ctx.device.type == "cuda":
            say(rank, f"NCCL network: {read_nccl_network(nccl_log)}", lines)
        max_mib = int(os.environ.get("PREFLIGHT_MAX_MB", SIZES_MIB[-1]))
        sizes = [size for size in SIZES_MIB if size <= max_mib]
        rows = measure_allreduce(ctx, sizes) if ctx.world_size > 1 else []
        local_size, nodes = ctx.local_world_size, ctx.nodes
        node_rows = []
        if nodes > 1 and local_size > 1:  # one node alone all-reduces over its own links only
            node_group, _ = dist.new_subgroups(group_size=local_size)
            node_rows = measure_allreduce(ctx, sizes, group=node_group)
        elif nodes == 1:
            node_rows = rows
        compute_seconds, synced_seconds, sent, crossing, (room, own) = step_seconds(task, cfg, ctx, compute_alone)
        short = room.shortfall() if own else None  # as each rank that writes sees its file system
        if short:
            say(rank, f"PROBLEM: {short}", lines)
        write_seconds = time_checkpoint_write(ctx, room.folder, own)
        (any_short, largest) = slowest(ctx, float(bool(short) or math.isinf(write_seconds)), float(own))
        fits, notice, numbers = save_in_notice(write_seconds, synced_seconds, cfg)
        if ctx.is_main:
            if compute_seconds is None:  # fsdp, the compute alone not timed: the step as measured
                prediction = {"comm_hook": cfg.comm_hook, "compute_seconds": None, "job_step_seconds": synced_seconds}
                summary = f"per optimizer step: {1000 * synced_seconds:.2f} ms; the compute alone was not timed"
            else:
                prediction = predict(compute_seconds, synced_seconds, sent, rows, node_rows, nodes, cfg.comm_hook)
                comm_seconds = max(synced_seconds - compute_seconds, 0.0)
                summary = verdict(comm_seconds, compute_seconds, ctx.world_size, cfg.strategy)
            writers = f"every rank its shards, at most {size_text(largest)}" if cfg.strategy == "fsdp" else "rank 0"
            saving = (f"{size_text(room.checkpoint)} a checkpoint, written and fsynced in {write_seconds:.3g} s "
                      f"(by {writers}); {room.summary()}")  # fmt: skip
            if as_json:
                checkpoint = {"bytes": room.checkpoint, "bytes_per_rank": largest, "peak_bytes": room.peak,
                              "free_bytes": room.free, "needed_bytes": room.needed,
                              "write_seconds": write_seconds if math.isfinite(write_seconds) else None,
                              **numbers}  # fmt: skip
                report = {"world_size": ctx.world_size, "nodes": nodes, "processes_per_node": local_size,
                          "backend": dist.get_backend(), "allreduce": bandwidth_rows(rows),
                          "one_node_allreduce": bandwidth_rows(node_rows), **prediction, "verdict": summary,
                          "internode_bytes_per_step": crossing, "checkpoint": checkpoint}  # fmt: skip
                print(json.dumps(report), flush=True)
            else:
                print(f"\nall-reduce over {ctx.world_size} processes ({dist.get_backend()}):")
                print(f"{'size':>8} {'time':>10} {'algbw':>11} {'busbw':>11}")
                for size_mib, seconds, algbw, busbw in rows:  # rates in nccl-tests' GB/s: 1e9 bytes a second
                    print(f"{size_mib:>4} MiB {1000 * seconds:>7.2f} ms {algbw:>6.2f} GB/s {busbw:>6.2f} GB/s")
                print(f"\nmodel: {size_text(sent[cfg.comm_hook])} of gradients")
                print(f"verdict: {summary}")
                if nodes > 1:
                    if compute_seconds is not None:
                        print(f"nodes: {hook_advice(prediction)}")
                    per_strategy = ", ".join(f"{name} {size_text(count)}" for name, count in crossing.items())
                    print(f"inter-node traffic a step, each node: {per_strategy} (hsdp: a replica a node)", flush=True)
                print(f"checkpoints: {saving}")
            if not (fits and as_json):  # with --json, a warning on stderr beside the object
                print(notice, file=lines, flush=True)
        if any_short:
            return 1  # said above, by the rank that found it
    except (PreflightError, InputError) as problem:
        say(rank, f"PROBLEM: {problem}", lines)
        return 1
    finally:
        cleanup_distributed()
    return 0


def bandwidth_rows(rows):
    return [{"size_bytes": size_mib * 2**20, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": busbw}
            for size_mib, seconds, algbw, busbw in rows]  # fmt: skip
