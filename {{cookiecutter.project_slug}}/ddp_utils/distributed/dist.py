"""The process group and its collectives: which device, which ranks.

- `setup_distributed` joins the group torchrun (or srun) describes, or forms a group of one, so
  `python train.py` runs the same code path as many processes; `cleanup_distributed` ends it.
- `Agreement` sums flags and values over every rank in one all-reduce the host does not wait for.
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

from ..errors import DeviceError
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


def local_gpu(local_rank):
    """This process's GPU: the LOCAL_RANK-th GPU it sees, or its only one.

    Schedulers often show each process just its own GPU (`srun --gpus-per-task=1`,
    CUDA_VISIBLE_DEVICES per rank): that GPU is then cuda:0 whatever LOCAL_RANK is.
    """
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but this process sees {count} GPUs: start at most one process per GPU "
            "(NPROC_PER_NODE), or show each process its own GPU (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


# Values of CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES that ask for no GPU (SLURM writes
# NoDevFiles where a job got none; the NVIDIA container runtime takes void and none).
NO_GPU_VALUES = {"", "-1", "none", "void", "nodevfiles"}


def gpus_requested(environ, nvidia_devices=None):
    """What asked for GPUs, as a short text naming the variable, or None: the job's scheduler
    or launcher gave this process GPUs (SLURM's GPU variables, CUDA_VISIBLE_DEVICES, or
    NVIDIA_VISIBLE_DEVICES set to devices where the NVIDIA driver's device files are:
    NVIDIA's CUDA images set it to `all` in the image itself, also on nodes without GPUs).
    `nvidia_devices`: whether /dev/nvidiactl exists (looked up when None)."""
    if nvidia_devices is None:
        nvidia_devices = os.path.exists("/dev/nvidiactl")
    names = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
    names += ("NVIDIA_VISIBLE_DEVICES",) if nvidia_devices else ()
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip().lower() not in NO_GPU_VALUES:
            return f"{name}={value}"
    if environ.get("SLURM_GPUS_ON_NODE", "0").isdigit() and int(environ.get("SLURM_GPUS_ON_NODE", "0")) > 0:
        return f"SLURM_GPUS_ON_NODE={environ['SLURM_GPUS_ON_NODE']}"
    return None


def cuda_driver_version():
    """The newest CUDA version the NVIDIA driver supports, e.g. (12, 8); None without a driver.
    Read from libcuda itself (cuDriverGetVersion needs no initialised device)."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, version.value % 1000 // 10


def cuda_unavailable_reason():
    """Why torch cannot use CUDA here, in one sentence with the fix."""
    build = f"this torch ({torch.__version__})"
    if torch.version.cuda is None:
        return f"{build} is a CPU-only build: install torch built for the nodes' CUDA (pytorch.org/get-started)"
    needed = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    driver = cuda_driver_version()
    if driver is None:
        return f"{build} is built for CUDA {torch.version.cuda}, but no NVIDIA driver is loaded (libcuda.so.1)"
    supports = f"the NVIDIA driver supports CUDA up to {driver[0]}.{driver[1]}"
    if driver < needed:
        return (
            f"{build} is built for CUDA {torch.version.cuda}, but {supports}: update the driver, or install "
            "torch built for an older CUDA"
        )
    return f"{build} is built for CUDA {torch.version.cuda} and {supports}, yet finds no usable GPU (see nvidia-smi)"


def choose_device(local_rank, device="auto", environ=os.environ):
    """This process's device for `--device` (auto, cuda or cpu). auto takes the GPU when CUDA
    works, and the CPU when no GPU was asked for; GPUs asked for but unusable (a broken driver,
    a torch built for a newer CUDA than the driver's, a CPU-only torch) raise DeviceError rather
    than train every rank at CPU speed."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return local_gpu(local_rank)
    asked = "--device cuda" if device == "cuda" else gpus_requested(environ)
    if asked:
        raise DeviceError(
            f"GPUs were asked for ({asked}) but CUDA is unavailable: {cuda_unavailable_reason()}; "
            "or pass --device cpu to train on the CPU"
        )
    return torch.device("cpu")


def set_tf32(enabled):
    """TF32 (Ampere and newer GPUs) for float32 matmuls and convolutions, or full float32.

    Set through the legacy flags (torch.backends.*.allow_tf32), which torch mirrors into its
    newer `fp32_precision` settings: both APIs then read the same value. Setting only the new
    one would leave the old unreadable ("a mix of the legacy and new APIs"), and Inductor and
    other libraries still read it. Returns what both now say (tf32_settings)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    return tf32_settings()


def tf32_settings():
    """Every TF32 setting by name, as each API reads it (the legacy flags, then the
    `fp32_precision` settings); one that cannot be read raises."""
    backends = torch.backends
    return {
        "cuda.matmul.allow_tf32": backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda.matmul.fp32_precision": backends.cuda.matmul.fp32_precision,
        "cudnn.conv.fp32_precision": backends.cudnn.conv.fp32_precision,
    }


def setup_distributed(timeout_seconds=600, trace_dir=None, device="auto"):
    """Join the process group that torchrun (or srun) describes, or form a group of one.

    Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; under `srun --ntasks-per-node=G python
    train.py`, SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS are (torchrun's take precedence). With
    neither (plain `python train.py`) a single-process group is made on an in-memory store,
    so the rest of the code runs one path: DDP, collectives and the sampler behave exactly as
    with more processes. On GPUs, NCCL's flight recorder keeps the last collectives of each
    rank and dumps them to `trace_dir` when a collective times out (docs/clusters.md: When it hangs).
    """
    env = process_env()
    rank, local_rank, world_size = env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]
    device = choose_device(local_rank, device)
    if device.type == "cuda":
        # Set the device before init so NCCL binds this process to its own GPU; the global
        # rank is no device index on any node but the first.
        backend = "nccl"
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


class HostCopy:
    """A tensor copied to the host without making the host wait for the device.

    On CUDA the copy goes to pinned memory behind the work already queued; `tolist()` waits
    only for that copy (an event), so read it a step later and it is long done. On the CPU
    there is nothing to wait for.
    """

    def __init__(self, tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def tolist(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Agreement:
    """Values summed over all ranks by one all-reduce that runs while the host goes on.

    A flag (0 or 1) summed is the number of ranks that raised it; a tensor's value summed is
    finite only if it is finite on every rank (NaN and inf survive a sum), so neither needs an
    operation of its own before the all-reduce. `result()` gives the sums; the training loop
    reads them one optimizer step after starting the all-reduce, so it never waits for the
    device (trainer.py, optimizer_step; faults.StepChecks).
    """

    def __init__(self, values, device):
        if device.type == "cpu":  # reading a CPU tensor costs nothing: one tensor from the values
            summed = torch.tensor([float(value) for value in values], dtype=torch.float64)
        else:  # on the device: a tensor made from a Python value would be a blocking copy
            summed = torch.stack([on_device(value, device) for value in values])
        work = dist.all_reduce(summed, async_op=True)
        if device.type == "cuda":
            work.wait()  # orders the copy after the all-reduce on the GPU; the host goes on
            self.work, self.copy = None, HostCopy(summed)
        else:
            self.work, self.copy = work, HostCopy(summed)

    def wait(self):
        """Until the all-reduce is done on the host's side (no collective left in flight)."""
        if self.work is not None:
            self.work.wait()

    def result(self):
        self.wait()
        return self.copy.tolist()


def on_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def any_rank(*flags, device):
    """True for each flag that is true on at least one rank: one all-reduce for all flags, waited for."""
    return [total > 0 for total in Agreement(flags, device).result()]
