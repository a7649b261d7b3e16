"""Check a cluster before a long job: run it under the same launcher as training.

    scripts/launch.sh --preflight [--json] [train.py flags]   # every node, as for training
    torchrun --standalone --nproc_per_node=2 preflight.py [--json]

Each process checks its place in the job, its GPUs and its network identity *before*
joining the process group (a bad hostname makes gloo or NCCL hang, not fail). Then all
processes run a collective under a timeout and measure all-reduce bandwidth from 1 MB to
256 MB. Rank 0 prints a table and a verdict: the estimated all-reduce time of this model's
gradients per step against the measured compute time of a step, so you see before the job
whether more nodes will train faster. Train flags (--hidden_dim, --batch_size, ...) size the
model as for training. Exit status: 0 all good, 1 a problem was found.

The prediction: a few training steps are timed with and without the gradients' all-reduce;
the synced step is the job's, and the difference is what communication costs as DDP runs it
(bucketed, overlapped with backward, with the library's overheads: on CPU gloo these are a
good part of it, more than the bytes on a fast link). One node all-reduces over its own links
only (nothing, with one process per node). Each comm hook sends other bytes (bf16: half;
powersgd: two thin matrices per weight matrix): its step differs by the all-reduce time of
those bytes at the measured bandwidth, and the verdict names the hook that pays most when the
configured one does not. `--json` prints all of it as one object on rank 0 (stdout; the
per-rank lines go to stderr).
"""

import ipaddress
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
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
from ddp_utils.dist import choose_device, cleanup_distributed, process_env, processes_per_node, setup_distributed
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
    layout = "its own GPU (one visible)" if count == 1 else f"{count} GPUs visible for {local_world_size} process(es)"
    return f"{layout}: trains on {device}, {torch.cuda.get_device_name(device)}"


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


def step_seconds(cfg, ctx, warmup=2):
    """One optimizer step timed as train.py runs it: the same Trainer (model, amp, TF32,
    compile), micro-batches of the training data, the optimizer step; once with the gradients'
    all-reduce skipped (DDP's no_sync: the compute alone) and once with it, as the job will run
    (its overlap with backward, the buckets, the library's overheads included). Each is timed
    over TIMED_SECONDS or MIN_REPEATS steps, whichever is more (at most MAX_REPEATS).

    Returns (compute seconds, synced seconds, {comm hook: bytes all-reduced per step}, {strategy:
    bytes each node sends to other nodes per step}): medians, the slowest rank's, so every rank
    agrees.
    """
    task, datasets, _ = check_inputs(cfg, ctx)  # bad data: an InputError, a PROBLEM line
    trainer = Trainer(cfg, ctx, task, datasets)

    def timed_step(sync):
        synchronize(ctx)
        started = time.perf_counter()
        for micro_step in range(cfg.grad_accum_steps):
            trainer.train_step(batch, sync=sync and micro_step == cfg.grad_accum_steps - 1)
        trainer.optimizer_step()
        synchronize(ctx)
        return time.perf_counter() - started

    try:
        batch = next(iter(trainer.train_loader))
        medians = []
        for sync in (False, True):
            for _ in range(warmup - 1):  # the first steps compile and tune kernels
                timed_step(sync)
            repeats = agreed_repeats(ctx, timed_step(sync))
            timings = sorted(timed_step(sync) for _ in range(repeats))
            medians.append(timings[repeats // 2])
        trainer.settle()  # the last step's agreement, in flight
        compute, synced = slowest(ctx, *medians)
        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        sent = {hook: gradient_bytes(parameters, hook) for hook in COMM_HOOKS}
        crossing = internode_bytes(parameters, cfg, ctx.world_size, ctx.nodes, sent, dist.get_backend())
    finally:
        trainer.close("finished")  # no tracker runs were opened
    return compute, synced, sent, crossing


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
    try:
        say(rank, check_place(env), lines)
        say(rank, check_gpus(env, cfg.device), lines)
        say(rank, check_network_identity(), lines)
    except PreflightError as problem:
        say(rank, f"PROBLEM: {problem}", lines)
        return 1
    nccl_log = log_nccl_network() if cfg.device != "cpu" and torch.cuda.is_available() else None
    ctx = setup_distributed(cfg.timeout_seconds, device=cfg.device)
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
        compute_seconds, synced_seconds, sent, crossing = step_seconds(cfg, ctx)
        if ctx.is_main:
            prediction = predict(compute_seconds, synced_seconds, sent, rows, node_rows, nodes, cfg.comm_hook)
            summary = verdict(max(synced_seconds - compute_seconds, 0.0), compute_seconds, ctx.world_size)
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
