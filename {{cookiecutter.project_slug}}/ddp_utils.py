"""Process group, collectives, rank-aware logging, signals and atomic checkpoints.

Rules this file enforces for the rest of the project:
- Rank-0-only side effects (files, console) go through `rank_zero_only`, which checks the
  *global* rank; code under it never calls a collective, which would hang the other ranks.
- Decisions that end or skip work are agreed by all ranks with one collective (`any_rank`).
- The process group is destroyed on every exit path (`cleanup_distributed` in a finally).
"""

import collections
import faulthandler
import functools
import gc
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("train")


@dataclass(frozen=True)
class DistContext:
    rank: int  # global rank: who writes files, logs and checkpoints
    local_rank: int  # rank on this node
    world_size: int
    device: torch.device  # this process's device: the only device index to use (pick_device)
    store: dist.Store  # the group's key-value store, for waits that collectives must not bound
    local_world_size: int = 1  # processes on this node

    @property
    def nodes(self):
        """Nodes in the job, when every node runs as many processes (1 if they differ)."""
        return self.world_size // self.local_world_size if self.world_size % self.local_world_size == 0 else 1

    @property
    def is_main(self):
        return self.rank == 0


def pick_device(local_rank):
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


class DeviceError(RuntimeError):
    """GPUs were asked for and CUDA cannot use them: the job must not train on the CPU instead."""


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
        return pick_device(local_rank)
    asked = "--device cuda" if device == "cuda" else gpus_requested(environ)
    if asked:
        raise DeviceError(
            f"GPUs were asked for ({asked}) but CUDA is unavailable: {cuda_unavailable_reason()}; "
            "or pass --device cpu to train on the CPU"
        )
    return torch.device("cpu")


def set_tf32(enabled):
    """TF32 (Ampere and newer GPUs) for float32 matmuls and convolutions, or full float32, through
    torch's `fp32_precision` settings. The legacy TF32 flags (torch.backends.*.allow_*) must not
    be used beside them: torch refuses to read a mix of the two APIs (inductor reads the new one)."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.rnn.fp32_precision = precision


def setup_distributed(timeout_seconds=600, trace_dir=None, device="auto"):
    """Join the process group that torchrun (or srun) describes, or form a group of one.

    Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; under `srun --ntasks-per-node=G python
    train.py`, SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS are (torchrun's take precedence). With
    neither (plain `python train.py`) a single-process group is made on an in-memory store,
    so the rest of the code runs one path: DDP, collectives and the sampler behave exactly as
    with more processes. On GPUs, NCCL's flight recorder keeps the last collectives of each
    rank and dumps them to `trace_dir` when a collective times out (README: When it hangs).
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
    if dist.is_initialized():
        # DDP's reducer sits in reference cycles that keep the process group alive past
        # destroy_process_group; freed only at interpreter exit, gloo's worker threads then
        # abort the process ("terminate called without an active exception"). Collect first.
        gc.collect()
        dist.destroy_process_group()


def global_rank():
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def rank_zero_only(fn):
    """Run `fn` on global rank 0 only; elsewhere it returns None. Never put collectives in `fn`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if global_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper


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
    """Flags OR-ed across all ranks by one all-reduce that runs while the host goes on.

    `result()` gives the agreed values; the training loop reads them one optimizer step after
    starting the all-reduce, so it never waits for the device (train.py, optimizer_step).
    """

    def __init__(self, flags, device):
        # Built on the device: a tensor made from a Python value on CUDA would be a blocking
        # copy, torch.full is a kernel launch.
        values = torch.stack([to_flag(flag, device) for flag in flags])
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        if device.type == "cuda":
            work.wait()  # orders the copy after the all-reduce on the GPU; the host goes on
            self.work, self.copy = None, HostCopy(values)
        else:
            self.work, self.copy = work, HostCopy(values)

    def wait(self):
        """Until the all-reduce is done on the host's side (no collective left in flight)."""
        if self.work is not None:
            self.work.wait()

    def result(self):
        self.wait()
        return [bool(v) for v in self.copy.tolist()]


def to_flag(flag, device):
    if isinstance(flag, torch.Tensor):
        return flag.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(flag), device=device)


def any_rank(*flags, device):
    """True for each flag that is true on at least one rank: one all-reduce for all flags, waited for."""
    return Agreement(flags, device).result()


_barrier_uses = collections.Counter()  # per name: each use waits for its own arrivals


def store_barrier(ctx, name, error=None, timeout_seconds=1800, knob="--checkpoint_timeout_seconds"):
    """Wait until every rank has arrived at `name`, up to `timeout_seconds`, through the store.

    For waits that collectives must not bound: while rank 0 writes a large checkpoint to a slow
    file system, the other ranks wait here rather than in a collective limited by
    --timeout_seconds. Each rank may report an error; returns one of those reported, or None.
    Every rank must call it with the same names in the same order (a name used again is a new
    barrier); `knob` is the flag that sets the limit, for the error message.
    """
    _barrier_uses[name] += 1
    key = f"barrier/{name}/{_barrier_uses[name]}"
    if error:
        ctx.store.set(f"{key}/error", error)
    if ctx.store.add(f"{key}/arrived", 1) == ctx.world_size:
        ctx.store.set(f"{key}/all", "1")
    try:
        ctx.store.wait([f"{key}/all"], timedelta(seconds=timeout_seconds))
    except (dist.DistError, RuntimeError) as failure:  # the store's wait timed out
        raise CheckpointError(
            f"rank {ctx.rank} waited more than {timeout_seconds} s for the other ranks at {name} "
            f"({type(failure).__name__}); raise {knob} if they are slow, not stuck"
        ) from None
    if ctx.store.check([f"{key}/error"]):
        return ctx.store.get(f"{key}/error").decode()
    return None


def share_from_main(ctx, name, value, timeout_seconds):
    """Rank 0's `value` (JSON data) on every rank, sent through the store: the others wait for
    it up to `timeout_seconds`, as in `store_barrier`."""
    key = f"shared/{name}"
    if ctx.is_main:
        ctx.store.set(key, json.dumps(value))
    else:
        try:
            ctx.store.wait([key], timedelta(seconds=timeout_seconds))
        except (dist.DistError, RuntimeError) as failure:
            raise CheckpointError(
                f"rank {ctx.rank} waited more than {timeout_seconds} s for rank 0 at {name} "
                f"({type(failure).__name__}); raise --checkpoint_timeout_seconds if the file system is slow"
            ) from None
    return json.loads(ctx.store.get(key))


# How a collective that ran past --timeout_seconds fails: gloo raises a RuntimeError from the
# operation (backward's all-reduce included), NCCL's watchdog reports the stuck work.
COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (send|recv) operation|Watchdog caught collective operation timeout"
)


def is_collective_timeout(error):
    """Whether `error` is a collective that ran past its timeout: not any error that says
    "timed out" (a DataLoader's `timeout`, a socket, a file system)."""
    return isinstance(error, RuntimeError) and COLLECTIVE_TIMEOUT.search(str(error)) is not None


def setup_logging(ctx, output_dir):
    """Rank 0 logs INFO to the console and output_dir/train.log; other ranks WARNING and up."""
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if ctx.is_main else logging.WARNING)
    formatter = logging.Formatter(f"%(asctime)s [rank {ctx.rank}] %(levelname)s %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout)]
    Path(output_dir).mkdir(parents=True, exist_ok=True)  # on every rank: a failure stops them all alike
    if ctx.is_main:
        handlers.append(logging.FileHandler(Path(output_dir) / "train.log"))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    return log


class StopRequest:
    """Remember a SIGTERM (torchrun, Kubernetes) or SIGUSR1 (SLURM --signal) for the loop.

    The handler only sets a flag: the loop agrees on it with the other ranks at the next
    step boundary, saves a checkpoint and exits. Doing work inside a signal handler could
    interrupt a collective halfway.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    @property
    def requested(self):
        return self.signum != 0


def write_stop_status(code):
    """Tell scripts/launch.sh that training stopped on a signal, its checkpoint saved: `code` is
    the process's exit status (128 + the signal's number), None clears it. torchrun exits 1
    after a signal whatever its workers did; launch.sh exits with this status instead."""
    path = os.environ.get("STOP_STATUS_FILE")
    if path:
        Path(path).write_text("" if code is None else f"{code}\n")


class Watchdog:
    """Say where this rank is stuck before the collective timeout ends the job.

    The loop calls `beat("train step 12")` as it goes. A daemon thread checks that a beat came
    within 90% of `timeout_seconds` (the collective timeout); if not, it logs which phase this
    rank has been stuck in and writes every thread's Python stack to stderr (faulthandler),
    once per stall. It looks often enough to do so before the timeout: every rank that is
    stuck reports, so the output shows which ranks were waiting where, the one stuck in its
    own code and the others waiting for it inside a collective. A stop signal during a stall
    in Python code (a stuck data read, a sleep) ends the process at once; a rank blocked inside
    a collective sees the signal only when the collective returns or times out.
    """

    def __init__(self, timeout_seconds, rank, stop):
        self.seconds = 0.9 * timeout_seconds
        self.period = min(1.0, 0.04 * timeout_seconds)  # reports land between 90% and 94%
        self.rank, self.stop = rank, stop
        self.phase, self.last_beat, self.reported, self.limit = "start-up", time.monotonic(), False, self.seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase, seconds=None):
        """Progress in `phase`; `seconds` allows a longer stall for this phase (checkpoint I/O)."""
        self.phase, self.last_beat, self.reported = phase, time.monotonic(), False
        self.limit = seconds or self.seconds

    def _watch(self):
        while not self._stop.wait(self.period):
            stalled = time.monotonic() - self.last_beat
            if stalled > self.limit and not self.reported:
                self.reported = True
                log.error(
                    "rank %d: no progress for %.0f s in %s; Python stacks of this rank follow on stderr",
                    self.rank,
                    stalled,
                    self.phase,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            if self.reported and self.stop.requested:
                # A stalled loop can never act on the stop request (and save); end now
                # rather than when the launcher's grace period runs out.
                log.error("rank %d: stop requested while stalled in %s; exiting", self.rank, self.phase)
                logging.shutdown()
                os._exit(1)

    def close(self):
        self._stop.set()


# --- checkpoints -------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(ctx, state, checkpoint_dir, step, keep, timeout_seconds):
    """Write `state` as last.pt (and step_<step>.pt) atomically; call on every rank.

    Global rank 0 writes; the others wait for it through the store, for up to `timeout_seconds`
    (not --timeout_seconds: a large checkpoint on a slow file system takes its time). A failed
    write (disk full) stops every rank with the same error instead of a hang.
    """
    error = _write_checkpoint(state, Path(checkpoint_dir), step, keep)
    error = store_barrier(ctx, f"checkpoint_step_{step}", error, timeout_seconds)
    if error:
        raise CheckpointError(error)


@rank_zero_only
def _write_checkpoint(state, checkpoint_dir, step, keep):
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        last = checkpoint_dir / "last.pt"
        if keep == 0:
            _atomic_save(state, last)
        else:
            numbered = checkpoint_dir / f"step_{step:09d}.pt"
            _atomic_save(state, numbered)
            # last.pt is a second name for the same file: no second write, still atomic.
            _atomic_link(numbered, last, state)
            for old in sorted(checkpoint_dir.glob("step_*.pt"))[:-keep]:
                old.unlink()
        _fsync_dir(checkpoint_dir)
    except Exception as error:  # OSError, or torch.save's RuntimeError when the disk fills mid-write
        log.error("could not write checkpoint to %s: %s", checkpoint_dir, error)
        return f"could not write checkpoint to {checkpoint_dir}: {error}"
    return None


def _atomic_save(state, path):
    write_atomically(path, lambda f: torch.save(state, f))


def write_atomically(path, write):
    """Write a file whole or not at all: `write(f)` fills a temporary binary file, renamed to
    `path` once on disk. A crash or a full disk while writing leaves only the temporary file
    behind; `path` is always either the previous complete file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_link(target, path, state):
    tmp = path.with_name(f".{path.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:  # a file system without hard links: write the state again
        _atomic_save(state, path)
    else:
        os.replace(tmp, path)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path):
    """Load one checkpoint; a damaged or foreign one raises CheckpointError naming it.

    A file (--strategy ddp) is the whole state. A folder (--strategy fsdp) gives the trainer's
    state only, after checking that every shard its metadata names is there in full; the
    model and optimizer shards are read later, by every rank (load_sharded_checkpoint).

    The file is memory-mapped on the host, not read: each process copies what it needs from
    it (onto its GPU, with load_state_dict), and the pages are the operating system's file
    cache, shared by the processes of a node; nothing is first put whole on any GPU.
    """
    path = Path(path)
    try:
        if path.is_dir():
            check_sharded_checkpoint(path)
            path = path / "trainer.pt"
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # truncated zip, unpickling error, wrong format, I/O error
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}: {error})") from None


def checkpoint_candidates(checkpoint_dir):
    """Every checkpoint in `checkpoint_dir`, newest first: by the step in its name, `last.pt`
    (or the folder `last` links to) before the numbered checkpoint it is the newest of. A
    folder holding both kinds (--strategy switched) is ordered by step across them."""
    checkpoint_dir = Path(checkpoint_dir)
    numbered = [(int(p.name.removesuffix(".pt").removeprefix("step_")), 0, p) for p in checkpoint_dir.glob("step_*")
                if p.name.removesuffix(".pt").removeprefix("step_").isdigit()]  # fmt: skip
    ordered = list(numbered)
    for name in ("last.pt", "last"):
        last = checkpoint_dir / name
        if last.exists():
            same_kind = [(step, path) for step, _, path in numbered if path.is_dir() == last.is_dir()]
            # The numbered checkpoint it is (a hard link, a symbolic link), else the newest of its kind.
            steps = [step for step, path in same_kind if os.path.samefile(path, last)] or [
                max((step for step, _ in same_kind), default=math.inf)
            ]
            ordered.append((steps[0], 1, last))
    return [path for _, _, path in sorted(ordered, key=lambda entry: entry[:2], reverse=True)]


def load_latest_checkpoint(checkpoint_dir, sharded_only=False):
    """The newest readable checkpoint in `checkpoint_dir`, skipping damaged ones with a warning:
    a file (--strategy ddp) or a folder of shards (fsdp); with `sharded_only` folders alone
    (--strategy fsdp reads no one-file checkpoint; ddp reads both).

    Returns (state, path), or (None, None) when the folder holds no checkpoint at all.
    Raises CheckpointError when checkpoints exist but none is readable: starting fresh
    over them would silently throw a run away.
    """
    everything = checkpoint_candidates(checkpoint_dir)
    candidates = [path for path in everything if path.is_dir() or not sharded_only]
    if everything and everything[0] not in candidates:
        raise CheckpointError(
            f"the newest checkpoint in {checkpoint_dir}, {everything[0].name}, is one file (--strategy ddp), which "
            "--strategy fsdp does not read: resume with --strategy ddp, or pass another --output_dir"
        )
    for path in candidates:
        try:
            return load_checkpoint(path), path
        except CheckpointError as error:
            warn_main(f"{error}; trying an older checkpoint")
    if candidates:
        names = ", ".join(str(p) for p in candidates)
        raise CheckpointError(f"no readable checkpoint among {names}; delete them or pass --resume none")
    return None, None


@rank_zero_only
def warn_main(message):
    log.warning(message)


# --- sharded checkpoints (--strategy fsdp) ------------------------------------------------
#
# checkpoints/step_000000040/ holds one .distcp file per rank (its shards of the model and
# optimizer state), DCP's .metadata, and trainer.pt (epoch, step, random generators, config),
# written into .step_000000040.tmp/ and renamed when complete. `last` is a symbolic link to
# the newest one, replaced atomically.


class PendingCheckpoint:
    """A sharded checkpoint being written; `finish()` waits for it, then makes it the newest."""

    def __init__(self, ctx, future, tmp, final, keep, timeout_seconds):
        self.ctx, self.future, self.tmp, self.final = ctx, future, tmp, final
        self.keep, self.timeout_seconds = keep, timeout_seconds

    def finish(self):
        error = None
        try:
            if self.future is not None:
                self.future.result()
        except Exception as failure:  # DCP's CheckpointException: every rank sees the same
            error = f"could not write checkpoint {self.final}: {_first_line(failure)}"
        error = store_barrier(self.ctx, f"sharded_written_{self.final.name}", error, self.timeout_seconds)
        if not error:
            error = _publish_sharded(self.tmp, self.final, self.keep)
        error = store_barrier(self.ctx, f"sharded_published_{self.final.name}", error, self.timeout_seconds)
        if error:
            raise CheckpointError(error)


def save_sharded_checkpoint(ctx, sharded, trainer_state, checkpoint_dir, step, keep, timeout_seconds, group, stager):
    """Start writing a sharded checkpoint on every rank; returns the PendingCheckpoint to finish.

    With a `stager` (DCP's AsyncStager), DCP copies the shards into its host buffers and writes
    them in a thread (on `group`, a process group of its own) while training goes on; without,
    it writes them before returning.
    """
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step:09d}"
    tmp = checkpoint_dir / f".{final.name}.tmp"
    error = _prepare_sharded(tmp, trainer_state)
    error = store_barrier(ctx, f"sharded_prepared_{final.name}", error, timeout_seconds)
    if error:
        raise CheckpointError(error)
    future = None
    try:
        if stager is None:
            dcp.save(sharded, checkpoint_id=str(tmp), process_group=group)
        else:
            future = dcp.async_save(sharded, checkpoint_id=str(tmp), process_group=group, async_stager=stager)
    except Exception as failure:  # DCP's CheckpointException: every rank sees the same
        raise CheckpointError(f"could not write checkpoint {final}: {_first_line(failure)}") from None
    return PendingCheckpoint(ctx, future, tmp, final, keep, timeout_seconds)


@rank_zero_only
def _prepare_sharded(tmp, trainer_state):
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
        tmp.mkdir(parents=True)
        _atomic_save(trainer_state, tmp / "trainer.pt")
    except Exception as error:
        log.error("could not write checkpoint to %s: %s", tmp.parent, error)
        return f"could not write checkpoint to {tmp.parent}: {error}"
    return None


@rank_zero_only
def _publish_sharded(tmp, final, keep):
    """Rename the complete `tmp` to `final`, point `last` at it, then prune: at every moment
    `last` and the step folders are complete checkpoints."""
    try:
        _fsync_dir(tmp)
        replaced = final.with_name(f".{final.name}.old")
        if final.exists():  # the same step saved again (a run resumed from an older one)
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        link = final.parent / ".last.link"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, final.parent / "last")
        _fsync_dir(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)
        # The newest `keep` step folders stay (at least the one `last` names), never this one.
        others = sorted(p for p in final.parent.glob("step_*") if p.is_dir() and p != final)
        for old in others[: len(others) - max(keep - 1, 0)]:
            shutil.rmtree(old)
    except OSError as error:
        log.error("could not write checkpoint to %s: %s", final.parent, error)
        return f"could not write checkpoint to {final.parent}: {error}"
    return None


def check_sharded_checkpoint(path):
    """Raise if a shard named in the checkpoint's metadata is missing or cut short."""
    # DCP is imported where it is used: it pulls in DTensor and sympy, 1.5 s of start-up per
    # process that ddp runs (one-file checkpoints) never need.
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    for info in metadata.storage_data.values():
        shard = Path(path) / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            raise ValueError(f"shard {shard.name} is missing or cut short")


def sharded_param_groups(path):
    """How many optimizer parameter groups the sharded checkpoint at `path` holds."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({key.split(".")[2] for key in keys if key.startswith("optimizer.param_groups.")})


def load_sharded_checkpoint(path, sharded, group):
    """Read this rank's shards of `sharded` from the checkpoint folder `path`, in place; every
    rank calls it (DCP reshards to this world size)."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    try:
        dcp.load(sharded, checkpoint_id=str(path), process_group=group)
    except Exception as failure:  # DCP's CheckpointException: every rank sees the same
        raise CheckpointError(f"checkpoint {path} is unreadable: {_first_line(failure)}") from None


def _first_line(error):
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
