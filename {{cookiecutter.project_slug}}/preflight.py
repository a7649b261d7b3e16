"""Check a cluster before a long job: run it under the same launcher as training.

    scripts/launch.sh --preflight [train.py flags]       # every node, as for training
    torchrun --standalone --nproc_per_node=2 preflight.py

Each process checks its place in the job, its GPUs and its network identity *before*
joining the process group (a bad hostname makes gloo or NCCL hang, not fail). Then all
processes run a collective under a timeout and measure all-reduce bandwidth from 1 MB to
256 MB. Rank 0 prints a table and a verdict: the estimated all-reduce time of this model's
gradients per step against the measured compute time of a step, so you see before the job
whether more nodes will train faster. Train flags (--hidden_dim, --batch_size, ...) size the
model as for training. Exit status: 0 all good, 1 a problem was found.
"""

import ipaddress
import math
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from config import parse_config
from ddp_utils import cleanup_distributed, pick_device, process_env, setup_distributed
from train import Trainer

SIZES_MB = (1, 4, 16, 64, 256)


class PreflightError(RuntimeError):
    pass


def say(rank, message):
    print(f"preflight [rank {rank}] {message}", flush=True)


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


def processes_per_node():
    """torchrun's LOCAL_WORLD_SIZE, or under srun the tasks on this node."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_TASKS_PER_NODE", "1")
    return int(value.split("(")[0].split(",")[0])  # SLURM may write "2(x3)" or "2,1"


def check_gpus(env):
    """The GPUs this process sees, and the one it will train on (as setup_distributed picks it)."""
    local_world_size = processes_per_node()
    if not torch.cuda.is_available():
        return "no GPU visible: training will use gloo on CPU"
    count = torch.cuda.device_count()
    if 1 < count < local_world_size:
        raise PreflightError(
            f"{count} GPUs visible but {local_world_size} processes on this node: lower NPROC_PER_NODE "
            "or check CUDA_VISIBLE_DEVICES"
        )
    try:
        device = pick_device(env["LOCAL_RANK"])
    except RuntimeError as error:
        raise PreflightError(str(error)) from None
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


def bus_bandwidth(algbw, world_size):
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(n-1)/n, comparable across sizes of n."""
    return algbw * 2 * (world_size - 1) / world_size


def measure_allreduce(ctx, sizes_mb, iterations=3):
    """Rows of (size_mb, seconds per all-reduce, algbw GB/s, busbw GB/s), all ranks agreeing."""
    rows = []
    for size_mb in sizes_mb:
        tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=ctx.device)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        synchronize(ctx)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        synchronize(ctx)
        elapsed = torch.tensor((time.perf_counter() - started) / iterations, device=ctx.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        seconds = elapsed.item()
        algbw = size_mb * 2**20 / seconds / 1e9
        rows.append((size_mb, seconds, algbw, bus_bandwidth(algbw, ctx.world_size)))
    return rows


def synchronize(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def allreduce_seconds(num_bytes, rows):
    """Estimated all-reduce time for `num_bytes`, from the measured row of the nearest size."""
    size_mb, seconds, _, _ = min(rows, key=lambda row: abs(math.log(row[0] * 2**20 / max(num_bytes, 1))))
    return seconds * num_bytes / (size_mb * 2**20)


def step_compute_seconds(cfg, ctx, repeats=5, warmup=2):
    """One optimizer step without communication, timed as train.py runs it: the same Trainer
    (model, amp, TF32, compile), micro-batches of the training data under DDP's no_sync, and
    the optimizer step. Returns (median seconds, bytes of gradients all-reduced per step)."""
    trainer = Trainer(cfg, ctx)
    try:
        inputs, targets = next(iter(trainer.train_loader))
        timings = []
        for _ in range(warmup + repeats):  # the first steps compile and tune kernels
            synchronize(ctx)
            started = time.perf_counter()
            for _ in range(cfg.grad_accum_steps):
                trainer._run_batch(inputs, targets, sync=False)
            trainer.scaler.step(trainer.optimizer)
            trainer.scaler.update()
            trainer.optimizer.zero_grad(set_to_none=True)
            synchronize(ctx)
            timings.append(time.perf_counter() - started)
        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        gradient_bytes = sum(p.numel() * p.element_size() for p in parameters)
    finally:
        trainer.close()
    return sorted(timings[warmup:])[repeats // 2], gradient_bytes


def verdict(comm_seconds, compute_seconds, world_size):
    ratio = comm_seconds / compute_seconds
    summary = (
        f"per optimizer step: compute {1000 * compute_seconds:.2f} ms, gradient all-reduce "
        f"~{1000 * comm_seconds:.2f} ms ({ratio:.2f}x compute)"
    )
    if world_size == 1:
        return summary + "; single process, nothing to all-reduce"
    if ratio < 0.5:
        return summary + ": compute-bound, adding processes should scale well"
    if ratio < 1:
        return summary + ": communication is a large share; DDP overlaps it with backward, expect sub-linear scaling"
    return summary + (
        ": communication-bound, more nodes may train SLOWER than one. Raise --batch_size or "
        "--grad_accum_steps, use a faster interconnect, or compress gradients"
    )


def main(argv=None):
    cfg = parse_config(argv)
    env = process_env()
    rank = env["RANK"]
    try:
        for check in (check_place, check_gpus):
            say(rank, check(env))
        say(rank, check_network_identity())
    except PreflightError as problem:
        say(rank, f"PROBLEM: {problem}")
        return 1
    ctx = setup_distributed(cfg.timeout_seconds)
    try:
        say(rank, check_collective(ctx))
        max_mb = int(os.environ.get("PREFLIGHT_MAX_MB", SIZES_MB[-1]))
        rows = measure_allreduce(ctx, [size for size in SIZES_MB if size <= max_mb]) if ctx.world_size > 1 else []
        compute_seconds, gradient_bytes = step_compute_seconds(cfg, ctx)
        if ctx.is_main:
            print(f"\nall-reduce over {ctx.world_size} processes ({dist.get_backend()}):")
            print(f"{'size':>8} {'time':>10} {'algbw':>11} {'busbw':>11}")
            for size_mb, seconds, algbw, busbw in rows:
                print(f"{size_mb:>5} MB {1000 * seconds:>7.2f} ms {algbw:>6.2f} GB/s {busbw:>6.2f} GB/s")
            comm_seconds = allreduce_seconds(gradient_bytes, rows) if rows else 0.0
            print(f"\nmodel: {gradient_bytes / 2**20:.1f} MB of gradients")
            print(f"verdict: {verdict(comm_seconds, compute_seconds, ctx.world_size)}", flush=True)
    except PreflightError as problem:
        say(rank, f"PROBLEM: {problem}")
        return 1
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
