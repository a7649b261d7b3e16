"""Data loading shared by every task: the split across ranks, the loaders and seeding.

dataset.py says what the data is (`build_datasets`); this file decides which process sees
which samples, in which order, with which random seeds. It works unchanged for any map-style
Dataset, whatever its items hold (contract.py).
"""

import functools
import hashlib
import os
import random
import signal
import threading

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .dist import agree
from .knobs import ConfigError


def mix_seed(*parts):
    """A 63-bit seed derived from any values, e.g. (seed, rank, epoch); distinct inputs never
    collide the way `seed + rank` does (seed 1, rank 0 == seed 0, rank 1)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ShardedSampler(Sampler):
    """DistributedSampler's split of one shuffled order, with batches independent of world size.

    Each epoch shuffles all indices with a generator seeded from (seed, epoch) only, keeps
    whole global batches and deals positions round-robin: rank r takes r, r+W, r+2W, ... So
    the samples in global batch k are the same set for any number of processes W with the
    same global batch size, and nothing is padded or duplicated. `start` (a multiple of the
    global batch) skips samples already trained on, for a mid-epoch resume.
    """

    def __init__(self, num_samples, global_batch_size, rank, world_size, seed):
        self.num_samples = num_samples
        self.usable = num_samples // global_batch_size * global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __iter__(self):
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_samples, generator=generator)[: self.usable]
        return iter(order[self.start + self.rank :: self.world_size].tolist())

    def __len__(self):
        return len(range(self.start + self.rank, self.usable, self.world_size))


# What a scheduler sends to stop a job: SIGTERM (torchrun, Kubernetes, scancel), SIGUSR1 (SLURM's
# --signal), SIGINT (Ctrl-C). torchrun signals each training process's whole process group and
# slurmstepd every process of a step, so DataLoader workers get them too; torch's own worker
# handler then dies (it exits quietly only for its parent's SIGTERM), and the training process
# fails with "DataLoader worker ... is killed by signal" instead of saving its checkpoint.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}


def ignore_stop_signals(worker_id, main_pid):
    """worker_init_fn: a worker ignores stop signals from anyone but the training process, which
    acts on them itself (it agrees on the stop, saves, and then shuts its loaders down).

    The signals are blocked and a thread takes them with sigwaitinfo, which names the sender:
    the training process's SIGTERM (DataLoader's own shutdown) still ends the worker at once.
    """
    parents = {main_pid, os.getppid()}  # the same process, unless a forkserver started us
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started later inherit the mask
    threading.Thread(target=_exit_on_parent_sigterm, args=(parents,), name="stop_signals", daemon=True).start()


def _exit_on_parent_sigterm(parents):
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid in parents:
            os._exit(0)  # as torch's handler does for its parent


def build_datasets(task, cfg, ctx):
    """The task's (train, validation) datasets (dataset.py's build_datasets). A bad setting or a
    missing data folder (a ConfigError) is agreed by all ranks (it may be missing on one node
    only) and reported once, before anyone waits in a collective."""
    datasets, problem = None, None
    try:
        datasets = task.build_datasets(cfg)
    except ConfigError as error:
        problem = str(error)
    agree(ctx, "datasets", problem, cfg.timeout_seconds)
    return datasets


def build_loaders(cfg, ctx, train_set, val_set):
    """The training loader (ShardedSampler) and the validation loader of this rank."""
    global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum_steps
    sampler = ShardedSampler(len(train_set), global_batch, ctx.rank, ctx.world_size, cfg.seed)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        pin_memory=ctx.device.type == "cuda",  # page-locked buffers make non_blocking copies async
        persistent_workers=cfg.num_workers > 0 and cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
        worker_init_fn=functools.partial(ignore_stop_signals, main_pid=os.getpid()),
    )
    # `start_epoch` seeds this generator from (seed, rank, epoch); from it torch seeds every
    # worker's torch, random and numpy generators with a distinct value per worker id (once
    # per epoch, or once per run with persistent workers). Augmentations then differ across
    # ranks and workers and repeat run to run; for exact mid-epoch resume, derive them from
    # (seed, epoch, index) like the built-in noise.
    train_loader = DataLoader(train_set, sampler=sampler, generator=torch.Generator(), **common)
    # Evaluation: every sample exactly once across ranks (ranks may get one sample more or
    # less than others; metrics are reduced as sums and counts, so that is exact). Its own
    # generator: evaluating draws nothing from the training's random streams.
    val_sampler = range(ctx.rank, len(val_set), ctx.world_size)
    val_generator = torch.Generator().manual_seed(mix_seed(cfg.seed, ctx.rank, "validation"))
    val_loader = DataLoader(val_set, sampler=val_sampler, generator=val_generator, **common)
    if common["persistent_workers"]:
        # Its workers start now, before training, and stay. Forked later, from a process whose
        # threads are busy with training, a worker can hang for good in CPython < 3.12's fork
        # (a thread held the interpreter's thread-list lock at that instant: seen here about
        # once in 15 resumed runs, stuck in _PyThreadState_DeleteExcept). The training loader's
        # workers start before the first step anyway.
        iter(val_loader)
    return train_loader, val_loader


def start_epoch(loader, epoch, rank, seed, start=0):
    """Call before iterating `loader` in an epoch (also on resume): new order, new noise,
    newly seeded workers."""
    loader.sampler.set_epoch(epoch, start)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    loader.generator.manual_seed(mix_seed(seed, rank, epoch))
