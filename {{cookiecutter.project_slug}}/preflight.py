"""Check a cluster before a long job: run it under the same launcher as training.

    scripts/launch.sh --preflight [--json] [train.py flags]   # every node, as for training
    torchrun --standalone --nproc_per_node=2 preflight.py [--json]

Each process checks its place in the job, its GPUs and its network identity *before*
joining the process group (a bad hostname makes gloo or NCCL hang, not fail; two processes
on one GPU make NCCL fail with "Duplicate GPU detected"). Then all
processes run a collective under a timeout and measure all-reduce bandwidth from 1 MB to
256 MB. Rank 0 prints a table and a verdict: the estimated all-reduce time of this model's
gradients per step against the measured compute time of a step, so you see before the job
whether more nodes will train faster. Train flags (--hidden_dim, --batch_size, ...) size the
model as for training. Exit status: 0 all good, 1 a problem was found.

The prediction: training steps are timed as train.py runs them, with and without the
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
"""

import contextlib
import dataclasses
import gc
import ipaddress
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from config import parse_config
from ddp_utils.comm_model import (
    COMM_HOOKS,
    bus_bandwidth,
    gradient_bytes,
    hook_advice,
    internode_bytes,
    predict,
    verdict,
)
from ddp_utils.contract import load_task
from ddp_utils.data import start_epoch
from ddp_utils.dist import (
    DistContext,
    choose_device,
    cleanup_distributed,
    group_prefix,
    process_env,
    processes_per_node,
    setup_distributed,
)
from ddp_utils.inputs import check_inputs
from ddp_utils.knobs import InputError
from train import Trainer

SIZES_MB = (1, 4, 16, 64, 256)
# Sizes past one all-reduce this long are not measured: on a slow link 256 MB takes minutes,
# and the larger sizes add nothing (the time per byte is already the link's).
SIZE_STOP_SECONDS = 1.0
# Steps are timed over at least this long (and at least MIN_REPEATS of them): 5 steps of 60 ms
# are a 0.3 s sample of a shared machine's speed, which stalls for longer than that.
TIMED_SECONDS = 1.0
MIN_REPEATS, MAX_REPEATS = 5, 25


class PreflightError(RuntimeError):
    pass


def say(rank, message, file=sys.stdout):
    print(f"preflight [rank {rank}] {message}", file=file, flush=True)


# --- local checks, before any collective -------------------------------------------------


def check_place(env):
    """Rank and world size as the launcher set them."""
    rank, local_rank, world_size = env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]
    local_world_size = processes_per_node()
    if not 0 <= rank < world_size:
        raise PreflightError(f"RANK {rank} is outside WORLD_SIZE {world_size}")
    if not 0 <= local_rank < local_world_size:
        raise PreflightError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE {local_world_size}")
    if world_size % local_world_size:
        raise PreflightError(f"WORLD_SIZE {world_size} is no multiple of the {local_world_size} processes per node")
    return f"rank {rank} of {world_size}, local rank {local_rank} of {local_world_size} on {socket.gethostname()}"


def check_gpus(env, device_knob):
    """The GPUs this process sees, and the one it will train on (as setup_distributed picks it)."""
    local_world_size = processes_per_node()
    try:
        device = choose_device(env["LOCAL_RANK"], device_knob)
    except RuntimeError as error:  # DeviceError, or pick_device's LOCAL_RANK beyond the GPUs
        raise PreflightError(str(error)) from None
    if device.type == "cpu":
        return f"no GPU asked for{' (--device cpu)' if device_knob == 'cpu' else ''}: training will use gloo on CPU"
    count = torch.cuda.device_count()
    if 1 < count < local_world_size:
        raise PreflightError(
            f"{count} GPUs visible but {local_world_size} processes on this node: lower NPROC_PER_NODE "
            "or check CUDA_VISIBLE_DEVICES"
        )
    layout = "one GPU visible" if count == 1 else f"{count} GPUs visible for {local_world_size} process(es)"
    return f"{layout}: trains on {device}, {gpu_identity(device)}"


def gpu_identity(device):
    """The physical GPU behind `device`: its name and UUID, the same in every process whatever
    index CUDA_VISIBLE_DEVICES gives it there."""
    properties = torch.cuda.get_device_properties(device)
    return f"{properties.name} GPU-{properties.uuid}"


def check_own_gpu(env, device, timeout_seconds):
    """Each process of this node trains on a GPU of its own. NCCL finds two on one GPU only as
    the process group forms ("Duplicate GPU detected"); a node where every process sees the same
    single GPU (CUDA_VISIBLE_DEVICES=0 for all, more processes than GPUs under a scheduler that
    shows each one GPU) gets there. So the processes of this node tell each other their GPU
    through the launcher's key-value store first, before NCCL starts.

    Returns (line, store): keep the store until the process group has its own (without
    torchrun, rank 0's store is the server the others connect to, for both)."""
    world_size = env["WORLD_SIZE"]
    timeout = timedelta(seconds=timeout_seconds)
    store, _, _ = next(dist.rendezvous("env://", env["RANK"], world_size, timeout=timeout))
    store = dist.PrefixStore(f"preflight_gpus_{group_prefix(os.environ, world_size)}", store)
    host = socket.gethostname()
    gpus = node_gpus(store, host, env["LOCAL_RANK"], processes_per_node(), gpu_identity(device), timeout)
    problem = shared_gpu_problem(gpus, host)
    if problem:
        raise PreflightError(problem)
    return f"each of the {len(gpus)} processes on {host} has a GPU of its own", store


def node_gpus(store, host, local_rank, local_world_size, gpu, timeout):
    """{local rank: its GPU} of every process on `host`, each process giving its own `gpu`."""
    store.set(f"{host}/{local_rank}", gpu)
    keys = [f"{host}/{other}" for other in range(local_world_size)]
    store.wait(keys, timeout)
    return {other: store.get(key).decode() for other, key in enumerate(keys)}


def shared_gpu_problem(gpus, host):
    """What is wrong when processes of one node share a GPU, else None. `gpus`: {local rank:
    the GPU it trains on (gpu_identity)}, every process of `host`."""
    ranks_of = {}
    for local_rank, gpu in sorted(gpus.items()):
        ranks_of.setdefault(gpu, []).append(local_rank)
    shared = [(gpu, ranks) for gpu, ranks in ranks_of.items() if len(ranks) > 1]
    if not shared:
        return None
    gpu, ranks = shared[0]
    named = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return (
        f"local ranks {named} on {host} would all train on one GPU, {gpu} (NCCL stops with 'Duplicate GPU "
        f"detected'): {len(gpus)} processes for {len(ranks_of)} GPU(s). Set NPROC_PER_NODE={len(ranks_of)}, "
        "or show each process its own GPU (CUDA_VISIBLE_DEVICES)"
    )


def interface_of(address):
    """The network interface holding `address`, from `ip -o -4 addr` (None if unknown)."""
    try:
        listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in listing.stdout.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    return None


def check_network_identity():
    """This host's name must resolve to the address it uses to reach MASTER_ADDR.

    gloo (and NCCL's bootstrap) advertise the address that the hostname resolves to, unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name an interface. If that address is not on the
    route to the other nodes (a hostname mapped to 127.0.1.1 in /etc/hosts, a management
    network), peers get "Connection refused" and the job hangs in its first collective.
    """
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "single process: no network needed"
    port = int(os.environ.get("MASTER_PORT", 29500))
    hostname = socket.gethostname()
    try:
        advertised = socket.gethostbyname(hostname)
    except OSError as error:
        raise PreflightError(f"hostname {hostname!r} does not resolve ({error}): add it to /etc/hosts or DNS") from None
    try:
        master_ip = socket.gethostbyname(master)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_ip, port))  # picks the route; sends nothing
            route_ip = probe.getsockname()[0]
    except OSError as error:
        raise PreflightError(f"MASTER_ADDR {master!r} is not reachable from {hostname} ({error})") from None
    interface = interface_of(route_ip)
    pinned = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if advertised != route_ip and not pinned and not ipaddress.ip_address(master_ip).is_loopback:
        fix = f"GLOO_SOCKET_IFNAME={interface} NCCL_SOCKET_IFNAME={interface}" if interface else "GLOO_SOCKET_IFNAME"
        raise PreflightError(
            f"hostname {hostname!r} resolves to {advertised}, but MASTER_ADDR {master} is reached from "
            f"{route_ip}{f' on {interface}' if interface else ''}: peers would connect to the wrong address "
            f"and hang. Set {fix} on this node, or map {hostname} to {route_ip} in /etc/hosts"
        )
    via = f"interface {pinned} (pinned)" if pinned else f"{route_ip} on {interface or 'its route'}"
    return f"{hostname} resolves to {advertised}; reaches MASTER_ADDR {master} via {via}"


# --- collectives ------------------------------------------------------------------------


def check_collective(ctx):
    value = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
    started = time.perf_counter()
    dist.all_reduce(value)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    if value.item() != expected:
        raise PreflightError(f"all-reduce returned {value.item()}, expected {expected}")
    return f"all-reduce of {ctx.world_size} ranks correct in {1000 * (time.perf_counter() - started):.1f} ms"


def measure_allreduce(ctx, sizes_mb, group=None, iterations=3):
    """Rows of (size_mb, seconds per all-reduce, algbw GB/s, busbw GB/s) over `group` (default:
    all processes), every rank agreeing; stops after the first size slower than SIZE_STOP_SECONDS."""
    rows = []
    world_size = dist.get_world_size(group)
    for size_mb in sizes_mb:
        tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=ctx.device)
        dist.all_reduce(tensor, group=group)  # warm-up: connections, buffers
        synchronize(ctx)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor, group=group)
        synchronize(ctx)
        (seconds,) = slowest(ctx, (time.perf_counter() - started) / iterations)
        algbw = size_mb * 2**20 / seconds / 1e9
        rows.append((size_mb, seconds, algbw, bus_bandwidth(algbw, world_size)))
        if seconds > SIZE_STOP_SECONDS:  # the same decision on every rank: `seconds` is agreed
            break
    return rows


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
        text += ": TCP, no InfiniBand/RoCE or EFA in use (README: Kubernetes, RDMA)"
    return text


def step_seconds(cfg, ctx, compute=None):
    """The job's optimizer step, timed as train.py runs it (step_times): the same Trainer
    (model, amp, TF32, compile), micro-batches of the training data, the optimizer step, the
    gradients' communication as the job will run it (its overlap with backward, the buckets,
    the library's overheads included). Under ddp also the compute alone: the same steps with
    the gradients' all-reduce skipped (DDP's no_sync). Under fsdp `compute` is that, timed
    before (compute_alone_seconds; None: not timed).

    Returns (compute seconds or None, synced seconds, {comm hook: bytes all-reduced per step},
    {strategy: bytes each node sends to other nodes per step}): the slowest rank's, so every
    rank agrees.
    """
    task, datasets, _ = check_inputs(cfg, ctx)  # bad data: an InputError, a PROBLEM line
    trainer = Trainer(cfg, ctx, task, datasets)
    fsdp = cfg.strategy == "fsdp"
    try:
        seconds = step_times(ctx, trainer, (True,) if fsdp else (False, True))
        trainer.settle()  # the last step's agreement, in flight
        compute = seconds.get(False, compute)
        unknown, compute, synced = slowest(ctx, float(compute is None), compute or 0.0, seconds[True])
        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        hooks = ("none",) if fsdp else COMM_HOOKS  # the comm hooks are DDP's
        sent = {hook: gradient_bytes(parameters, hook) for hook in hooks}
        crossing = internode_bytes(parameters, cfg, ctx.world_size, ctx.nodes, sent, dist.get_backend())
    finally:
        trainer.close("finished")  # no tracker runs were opened
    return None if unknown else compute, synced, sent, crossing


def step_times(ctx, trainer, kinds, warmup=2, runs=3):
    """{sync: seconds an optimizer step takes} for each kind of step in `kinds` (True: with the
    gradients' all-reduce, on the last micro-step as in training; False: without, DDP's
    no_sync), as train.py's loop runs steps: one after another, each micro-step on the
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
    """Start-up's garbage collected, and the objects left out of Python's collections while
    steps are timed. Else its first full collection after start-up (the 10^6 objects that
    importing torch and building DDP leave: 0.2-0.4 s on this CPU) falls on whichever step
    the allocation counts decide, inside a timed run or not; a long job pays it once."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # cleanup_distributed's collection must reach DDP's reducer (its cycles)


def training_batches(trainer):
    """The training loader's batches, epoch after epoch, as train.py's loop draws them."""
    for epoch in itertools.count():
        start_epoch(trainer.train_loader, epoch, trainer.ctx.rank, trainer.cfg.seed)
        yield from trainer.train_loader


def compute_alone_seconds(cfg, env):
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
    task = load_task()
    try:
        datasets = task.build_datasets(cfg)
    except (InputError, OSError):
        return None, "compute alone not timed: the data cannot be read"
    alone_cfg = dataclasses.replace(cfg, replicate_degree=1)  # one process: plain FSDP
    with process_group_of_one(device, cfg.timeout_seconds) as alone:
        try:
            trainer = Trainer(alone_cfg, alone, task, datasets)
            try:
                seconds = step_times(alone, trainer, (True,))[True]
                trainer.settle()
            finally:
                trainer.close("finished")
        except torch.OutOfMemoryError:
            return None, "compute alone not timed: the whole model does not fit one GPU"
    return seconds, f"compute alone (fsdp over this process only): {1000 * seconds:.2f} ms a step"


@contextlib.contextmanager
def process_group_of_one(device, timeout_seconds):
    """This process as the only one of a process group (an in-memory store), on `device`: the
    DistContext of a job of one process."""
    store = dist.HashStore()
    device_id = device if device.type == "cuda" else None
    if device_id is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_id is not None else "gloo", store=store, rank=0, world_size=1,
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


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv  # preflight's own flag; the rest are train.py's
    argv = [arg for arg in argv if arg != "--json"]
    cfg = parse_config(argv)
    env = process_env()
    rank = env["RANK"]
    lines = sys.stderr if as_json else sys.stdout  # --json: stdout holds the object alone
    store = None  # check_own_gpu's, kept until the process group has its own
    try:
        say(rank, check_place(env), lines)
        say(rank, check_gpus(env, cfg.device), lines)
        say(rank, check_network_identity(), lines)
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
        compute_alone, line = compute_alone_seconds(cfg, env)
        say(rank, line, lines)
    ctx = setup_distributed(cfg.timeout_seconds, device=cfg.device)
    del store  # the process group has a store of its own now
    try:
        say(rank, check_collective(ctx), lines)
        if ctx.device.type == "cuda":
            say(rank, f"NCCL network: {read_nccl_network(nccl_log)}", lines)
        max_mb = int(os.environ.get("PREFLIGHT_MAX_MB", SIZES_MB[-1]))
        sizes = [size for size in SIZES_MB if size <= max_mb]
        rows = measure_allreduce(ctx, sizes) if ctx.world_size > 1 else []
        local_size, nodes = ctx.local_world_size, ctx.nodes
        node_rows = []
        if nodes > 1 and local_size > 1:  # one node alone all-reduces over its own links only
            node_group, _ = dist.new_subgroups(group_size=local_size)
            node_rows = measure_allreduce(ctx, sizes, group=node_group)
        elif nodes == 1:
            node_rows = rows
        compute_seconds, synced_seconds, sent, crossing = step_seconds(cfg, ctx, compute_alone)
        if ctx.is_main:
            if compute_seconds is None:  # fsdp, the compute alone not timed: the step as measured
                prediction = {"comm_hook": cfg.comm_hook, "compute_seconds": None, "job_step_seconds": synced_seconds}
                summary = f"per optimizer step: {1000 * synced_seconds:.2f} ms; the compute alone was not timed"
            else:
                prediction = predict(compute_seconds, synced_seconds, sent, rows, node_rows, nodes, cfg.comm_hook)
                comm_seconds = max(synced_seconds - compute_seconds, 0.0)
                summary = verdict(comm_seconds, compute_seconds, ctx.world_size, cfg.strategy)
            if as_json:
                report = {"world_size": ctx.world_size, "nodes": nodes, "processes_per_node": local_size,
                          "backend": dist.get_backend(), "allreduce": table(rows),
                          "one_node_allreduce": table(node_rows), **prediction, "verdict": summary,
                          "internode_bytes_per_step": crossing}  # fmt: skip
                print(json.dumps(report), flush=True)
            else:
                print(f"\nall-reduce over {ctx.world_size} processes ({dist.get_backend()}):")
                print(f"{'size':>8} {'time':>10} {'algbw':>11} {'busbw':>11}")
                for size_mb, seconds, algbw, busbw in rows:
                    print(f"{size_mb:>5} MB {1000 * seconds:>7.2f} ms {algbw:>6.2f} GB/s {busbw:>6.2f} GB/s")
                print(f"\nmodel: {sent[cfg.comm_hook] / 2**20:.1f} MB of gradients")
                print(f"verdict: {summary}")
                if nodes > 1:
                    if compute_seconds is not None:
                        print(f"nodes: {hook_advice(prediction)}")
                    per_strategy = ", ".join(f"{name} {count / 2**20:.1f} MB" for name, count in crossing.items())
                    print(f"inter-node traffic a step, each node: {per_strategy} (hsdp: a replica a node)", flush=True)
    except (PreflightError, InputError) as problem:
        say(rank, f"PROBLEM: {problem}", lines)
        return 1
    finally:
        cleanup_distributed()
    return 0


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


def table(rows):
    return [{"size_bytes": size_mb * 2**20, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": busbw}
            for size_mb, seconds, algbw, busbw in rows]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
