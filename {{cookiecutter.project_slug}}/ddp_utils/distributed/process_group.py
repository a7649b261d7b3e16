"""The process group: which ranks, on which nodes, joined how.

- `setup_distributed` joins the group torchrun (or srun) describes, or forms a group of one, so
  `python train.py` runs the same code path as many processes; `cleanup_distributed` ends it.
- The waits through the key-value store, and the heartbeats that bound them, are
  `store_waits.py`'s: `setup_distributed` starts this process's heartbeat.
"""

import gc
import os
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .device import choose_device
from .store_waits import start_heartbeats, stop_heartbeats


@dataclass(frozen=True)
class DistContext:
    rank: int  # global rank: who writes files, logs and checkpoints
    local_rank: int  # rank on this node
    world_size: int
    device: torch.device  # this process's device: the only device index to use (local_gpu)
    store: dist.Store  # the group's key-value store, for waits that collectives must not bound
    local_world_size: int = 1  # processes on this node

    @property
    def nodes(self):
        """Nodes in the job, when every node runs as many processes (1 if they differ)."""
        return self.world_size // self.local_world_size if self.world_size % self.local_world_size == 0 else 1

    @property
    def is_main(self):
        return self.rank == 0


def setup_distributed(timeout_seconds=600, trace_dir=None, device="auto", host_collectives=False):
    """Join the process group that torchrun (or srun) describes, or form a group of one.

    Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; under `srun --ntasks-per-node=G python
    train.py`, SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS are (torchrun's take precedence). With
    neither (plain `python train.py`) a single-process group is made on an in-memory store,
    so the rest of the code runs one path: DDP, collectives and the sampler behave exactly as
    with more processes. On GPUs, NCCL's flight recorder keeps the last collectives of each
    rank and dumps them to `trace_dir` when a collective times out (docs/clusters.md: When it hangs).
    With `host_collectives` (--cpu_offload) the GPUs' group runs collectives on CPU tensors too.
    """
    env = process_env()
    rank, local_rank, world_size = env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]
    device = choose_device(local_rank, device)
    if device.type == "cuda":
        # Set the device before init so NCCL binds this process to its own GPU; the global
        # rank is no device index on any node but the first.
        backend = "nccl"
        if host_collectives:
            # --cpu_offload: the sharded parameters and gradients live in host memory, and the
            # collectives on them (clipping's norm, Muon's exchange) need a backend for CPU
            # tensors beside NCCL, in the same group (torchtune#1977).
            backend = "cuda:nccl,cpu:gloo"
        torch.cuda.set_device(device)
        if trace_dir is not None:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{trace_dir}/rank_")
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_seconds)
    # device_id: NCCL connects at init (errors surface here, not in the first all-reduce).
    device_id = device if device.type == "cuda" else None
    if world_size > 1 or "RANK" in os.environ:
        # torchrun's agent keeps one key-value store across restarts and membership changes;
        # keys left by an earlier group can make the new one connect to a dead peer and hang.
        # Each group therefore gets its own key space: a restart raises the restart count, a
        # node joining raises the world size.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(group_prefix(os.environ, world_size), store)
    else:
        store = dist.HashStore()
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    if world_size > 1:
        start_heartbeats(store, rank, world_size)
    return DistContext(rank, local_rank, world_size, device, store, processes_per_node())


def processes_per_node():
    """torchrun's LOCAL_WORLD_SIZE, or under srun the tasks on this node."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_TASKS_PER_NODE", "1")
    return int(value.split("(")[0].split(",")[0])  # SLURM may write "2(x3)" or "2,1"


def group_prefix(environ, world_size):
    """The store key space of this process group (see setup_distributed)."""
    return f"restart_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}_world_{world_size}"


def process_env():
    """This process's place in the job: from torchrun's variables, else SLURM's, else alone.

    For SLURM's one-task-per-GPU style, MASTER_ADDR defaults to the first node of the
    allocation and MASTER_PORT to a port derived from the job id; both are exported so
    `env://` rendezvous finds them.
    """
    if "RANK" in os.environ:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        return {name: int(os.environ[name]) for name in names}
    # SLURM_STEP_NUM_TASKS: the tasks of this srun step (not of the whole allocation).
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1 and "SLURM_PROCID" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            command = ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]
            hostnames = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()
            os.environ["MASTER_ADDR"] = hostnames[0]
        os.environ.setdefault("MASTER_PORT", str(job_port(int(os.environ["SLURM_JOB_ID"]))))
        return {
            "RANK": int(os.environ["SLURM_PROCID"]),
            "LOCAL_RANK": int(os.environ["SLURM_LOCALID"]),
            "WORLD_SIZE": int(os.environ["SLURM_STEP_NUM_TASKS"]),
        }
    return {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1}


def job_port(job_id):
    """A port for a SLURM job: 20000-32767, below Linux's ephemeral range (32768 and up), where
    the kernel hands out ports for outgoing connections and a listener could find it taken.
    scripts/slurm.sbatch derives its rendezvous port the same way."""
    return 20000 + job_id % 12768


def cleanup_distributed():
    stop_heartbeats()
    if dist.is_initialized():
        # DDP's reducer sits in reference cycles that keep the process group alive past
        # destroy_process_group; freed only at interpreter exit, gloo's worker threads then
        # abort the process ("terminate called without an active exception"). Collect first.
        gc.collect()
        dist.destroy_process_group()
