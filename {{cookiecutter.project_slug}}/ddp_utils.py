"""Process group, collectives, rank-aware logging, signals and atomic checkpoints.

Rules this file enforces for the rest of the project:
- Rank-0-only side effects (files, console) go through `rank_zero_only`, which checks the
  *global* rank; code under it never calls a collective, which would hang the other ranks.
- Decisions that end or skip work are agreed by all ranks with one collective (`any_rank`).
- The process group is destroyed on every exit path (`cleanup_distributed` in a finally).
"""

import faulthandler
import functools
import gc
import logging
import os
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
    local_rank: int  # rank on this node: the only valid device index
    world_size: int
    device: torch.device

    @property
    def is_main(self):
        return self.rank == 0


def setup_distributed(timeout_seconds=600):
    """Join the process group that torchrun (or srun) describes, or form a group of one.

    Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; under `srun --ntasks-per-node=G python
    train.py`, SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS are (torchrun's take precedence). With
    neither (plain `python train.py`) a single-process group is made on an in-memory store,
    so the rest of the code runs one path: DDP, collectives and the sampler behave exactly as
    with more processes.
    """
    env = process_env()
    rank, local_rank, world_size = env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]
    if torch.cuda.is_available():
        # Set the device before init so NCCL binds this process to its own GPU; the global
        # rank is no device index on any node but the first.
        # (modulo: a scheduler may show each process only its own GPU)
        gpu = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        device, backend = torch.device("cuda", gpu), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_seconds)
    # NCCL: a collective past the timeout ends the process instead of hanging forever.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if world_size > 1 or "RANK" in os.environ:
        # torchrun's agent keeps one key-value store across restarts; keys left by a killed
        # attempt can make the restarted group connect to a dead peer and hang. Each restart
        # therefore gets its own key space.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(rank, local_rank, world_size, device)


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
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
        return {
            "RANK": int(os.environ["SLURM_PROCID"]),
            "LOCAL_RANK": int(os.environ["SLURM_LOCALID"]),
            "WORLD_SIZE": int(os.environ["SLURM_STEP_NUM_TASKS"]),
        }
    return {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1}


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


def any_rank(*flags, device):
    """True for each flag that is true on at least one rank: one all-reduce for all flags.

    Flags may be bools or 0-dim tensors already on `device` (no host sync before the reduce).
    """
    values = [torch.as_tensor(flag, dtype=torch.float32, device=device) for flag in flags]
    reduced = torch.stack(values)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return [bool(v) for v in reduced.tolist()]


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


class Watchdog:
    """Say where this rank is stuck before the collective timeout ends the job.

    The loop calls `beat("train step 12")` as it goes. A daemon thread checks that a beat came
    within `seconds`; if not, it logs which phase this rank has been stuck in and writes every
    thread's Python stack to stderr (faulthandler), once per stall. Each rank does this, so the
    output shows which ranks were waiting where: the one stuck in its own code, and the others
    waiting for it inside a collective. A stop signal during a stall in Python code (a stuck
    data read, a sleep) ends the process at once; a rank blocked inside a collective sees the
    signal only when the collective returns or times out.
    """

    def __init__(self, seconds, rank, stop):
        self.seconds, self.rank, self.stop = seconds, rank, stop
        self.phase, self.last_beat, self.reported = "start-up", time.monotonic(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase):
        self.phase, self.last_beat, self.reported = phase, time.monotonic(), False

    def _watch(self):
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            stalled = time.monotonic() - self.last_beat
            if stalled > self.seconds and not self.reported:
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


def save_checkpoint(ctx, state, checkpoint_dir, step, keep):
    """Write `state` as last.pt (and step_<step>.pt) atomically; call on every rank.

    Global rank 0 writes; the others wait in the collective that reports whether it worked,
    so a failed write (disk full) stops every rank with the same error instead of a hang.
    """
    error = _write_checkpoint(state, Path(checkpoint_dir), step, keep)
    if any_rank(error is not None, device=ctx.device)[0]:
        raise CheckpointError(error or "checkpoint write failed on rank 0; see its log")


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
    # A crash or a full disk while writing leaves only the temporary file behind;
    # `path` is always either the previous complete checkpoint or the new one.
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
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


def load_checkpoint(path, device):
    """Load one checkpoint; a damaged or foreign file raises CheckpointError naming it."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # truncated zip, unpickling error, wrong format, I/O error
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}: {error})") from None


def checkpoint_candidates(checkpoint_dir):
    """last.pt first, then the numbered checkpoints, newest first."""
    checkpoint_dir = Path(checkpoint_dir)
    numbered = sorted(checkpoint_dir.glob("step_*.pt"), reverse=True)
    last = checkpoint_dir / "last.pt"
    return ([last] if last.exists() else []) + numbered


def load_latest_checkpoint(checkpoint_dir, device):
    """The newest readable checkpoint in `checkpoint_dir`, skipping damaged ones with a warning.

    Returns (state, path), or (None, None) when the folder holds no checkpoint at all.
    Raises CheckpointError when checkpoints exist but none is readable: starting fresh
    over them would silently throw a run away.
    """
    candidates = checkpoint_candidates(checkpoint_dir)
    for path in candidates:
        try:
            return load_checkpoint(path, device), path
        except CheckpointError as error:
            warn_main(f"{error}; trying an older checkpoint")
    if candidates:
        names = ", ".join(str(p) for p in candidates)
        raise CheckpointError(f"no readable checkpoint among {names}; delete them or pass --resume none")
    return None, None


@rank_zero_only
def warn_main(message):
    log.warning(message)
