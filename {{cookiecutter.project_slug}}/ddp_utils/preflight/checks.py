"""The preflight's checks of one process before it joins the job (its place, its GPU, its
network identity), and its measurements once it has (a collective under a timeout, all-reduce
bandwidth, the network NCCL picks, how fast the checkpoint folder takes a checkpoint against
the stop notice). preflight.py runs them."""

import ipaddress
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

from ..checkpoint.space import existing, size_text
from ..distributed.dist import (
    choose_device,
    group_prefix,
    processes_per_node,
)
from ..errors import PreflightError
from .comm_model import (
    bus_bandwidth,
)

# Sizes past one all-reduce this long are not measured: on a slow link 256 MB takes minutes,
# and the larger sizes add nothing (the time per byte is already the link's).
SIZE_STOP_SECONDS = 1.0
# A checkpoint's write is timed on at most this much of it per rank, then scaled up: enough for
# a file system's steady speed, without minutes of writing a large model's on a slow one.
WRITE_SAMPLE_BYTES = 256 * 2**20
# How long torchrun waits for its workers after passing a stop signal on, unless told
# (PET_SHUTDOWN_TIMEOUT, which scripts/launch.sh sets from STOP_GRACE_SECONDS).
TORCHRUN_STOP_WAIT = 30


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
    except RuntimeError as error:  # DeviceError, or local_gpu's LOCAL_RANK beyond the GPUs
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


# --- the checkpoint folder ----------------------------------------------------------------


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


def stop_notice(environ=os.environ):
    """(seconds the workers get after a stop signal, the line that says where that comes from):
    torchrun's wait after passing the signal on (PET_SHUTDOWN_TIMEOUT: scripts/launch.sh sets
    it to STOP_GRACE_SECONDS less 10 s for the launchers, past 20 s), else torchrun's own 30 s."""
    grace, wait = environ.get("STOP_GRACE_SECONDS"), environ.get("PET_SHUTDOWN_TIMEOUT")
    grace, wait = (value if value and value.isdigit() else None for value in (grace, wait))
    if wait is None and grace is not None:
        wait = int(grace) - 10 if int(grace) > 20 else int(grace)
    if wait is None:
        return (
            TORCHRUN_STOP_WAIT,
            f"no STOP_GRACE_SECONDS (not scripts/launch.sh): torchrun's own {TORCHRUN_STOP_WAIT} s",
        )
    return int(wait), f"STOP_GRACE_SECONDS {grace}" if grace is not None else f"PET_SHUTDOWN_TIMEOUT {wait}"


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
    budget, source = stop_notice(environ)
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
