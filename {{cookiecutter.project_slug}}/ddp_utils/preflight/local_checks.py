"""The preflight's checks of one process before it joins the job: its place (rank, world size),
its GPU (its own, not another process's), its network identity (the address its peers reach).
Each raises PreflightError with the line that names the fix."""

import ipaddress
import os
import socket
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.units import size_text
from ..data.shards import is_sharded, shown, time_download
from ..distributed.device import choose_device
from ..distributed.process_group import group_prefix, processes_per_node
from ..errors import DataUnavailable, InputError, PreflightError


def say(rank, message, file=sys.stdout):
    print(f"preflight [rank {rank}] {message}", file=file, flush=True)


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


def check_data_store(data_dir, local_rank):
    """Data in shards at a URL: each node's first process fetches a shard and says how long an
    epoch's shards take to download at that rate (None: local data, or not this node's first)."""
    if local_rank != 0 or not is_sharded(data_dir) or "://" not in data_dir:
        return None
    try:
        seconds, size, epoch = time_download(data_dir)
    except (InputError, DataUnavailable) as error:
        raise PreflightError(f"{shown(data_dir)}: {error}") from None
    rate = size / max(seconds, 1e-9)
    return (
        f"data: a {size_text(size)} shard of {shown(data_dir)} fetched and checked in {seconds:.3g} s "
        f"({rate / 1e6:.3g} MB/s): an epoch's {size_text(epoch)} of shards takes ~{epoch / rate:.3g} s at this rate"
    )
