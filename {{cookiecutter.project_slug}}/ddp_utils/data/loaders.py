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
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler, default_collate

from ..distributed.store_waits import agree
from ..errors import InputError


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
    global batch) skips samples already trained on, for a mid-epoch resume. A dataset read in
    shards hands its own `epoch_order(seed, epoch)` (shards.shard_order: a few shards at a time),
    as pure a function of (seed, epoch) as the shuffle it replaces.
    """

    def __init__(self, num_samples, global_batch_size, rank, world_size, seed, epoch_order=None):
        self.num_samples, self.epoch_order = num_samples, epoch_order
        self.usable = num_samples // global_batch_size * global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __iter__(self):
        if self.epoch_order is not None:
            order = self.epoch_order(self.seed, self.epoch)[: self.usable]
        else:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator)[: self.usable]
        return iter(order[self.start + self.rank :: self.world_size].tolist())

    def __len__(self):
        return len(range(self.start + self.rank, self.usable, self.world_size))


class Batch(Sequence):
    """A batch that a dataset's `__getitems__(indices)` gathered at once: `Batch(inputs,
    targets)`, each field a tensor whose first dimension is the batch (one index operation on
    tensors held in memory, say).

    To torch's DataLoader and default_collate it is what `__getitems__` should return, the list
    of the batch's `(input, target)` samples, so any loader still works. The loaders of
    build_loaders (`collate`) take its fields as they are instead: default_collate would unbind
    the batch and stack it again one sample at a time, a GPU's wait with a small model.
    """

    def __init__(self, *fields):
        self.fields = fields

    def __len__(self):
        return len(self.fields[0])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return tuple(field[index] for field in self.fields)

    def __iter__(self):
        return zip(*(field.unbind() for field in self.fields))

    def collated(self):
        """What default_collate makes of the samples (a list of the fields stacked): the fields."""
        return list(self.fields)


def collate(batch):
    """The loaders' collate_fn: a dataset's Batch as it is, a list of samples default-collated."""
    return batch.collated() if isinstance(batch, Batch) else default_collate(batch)


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


def checked_datasets(task, cfg, ctx):
    """The task's (train, validation) datasets (its build_datasets), checked before
    anything is written: returns ((train, val), notes to log), or raises InputError on every
    rank alike (train.py prints it once: `error: ...`, exit status 2).

    - A bad setting or missing data (dataset.py raises InputError or ConfigError; an OSError
      reading a file) is agreed by all ranks: it may be missing on one node only.
    - Datasets with `check_samples` are scanned for bad samples before the first step, each
      rank a share (find_bad_samples): those of both sets are reported at once, or left out
      with --skip_bad_files (`without(indices)`, the same on every rank).
    - The training set holds at least one global batch, the validation set a sample.
    """
    datasets, problem = None, None
    try:
        datasets = task.build_datasets(cfg)
    except (InputError, OSError) as error:
        problem = str(error)
    agree(ctx, "datasets", problem, cfg.timeout_seconds, InputError)
    found = {name: find_bad_samples(ctx, data) for name, data in zip(SPLITS, datasets)}
    reports = [
        f"{describe_bad_samples(bad)} in the {name} set ({shown_problems(bad)})" for name, bad in found.items() if bad
    ]
    if reports and (not cfg.skip_bad_files or any(-1 in bad for bad in found.values())):
        raise InputError(f"{', '.join(reports)}: --skip_bad_files true trains without them")
    train, val = (data.without(sorted(found[name])) if found[name] else data for name, data in zip(SPLITS, datasets))
    notes = [f"--skip_bad_files: training without {report}" for report in reports]
    global_batch = global_batch_size(cfg, ctx)
    if len(train) < global_batch:
        raise InputError(
            f"the training set has {len(train)} samples, fewer than one global batch of {global_batch} "
            f"(--batch_size {cfg.batch_size} x {ctx.world_size} processes x --grad_accum_steps {cfg.grad_accum_steps})"
        )
    if len(val) == 0:
        raise InputError("the validation set is empty")
    return (train, val), notes


SPLITS = ("training", "validation")
SHOWN_PROBLEMS = 20  # bad samples named in the error; the rest are counted


def find_bad_samples(ctx, dataset):
    """{index: problem} of the samples of `dataset` that would fail mid-epoch (a corrupt image,
    say): every rank checks a share with the dataset's `check_samples(indices)`, and every rank
    gets all the problems. Empty for a dataset without `check_samples`. Key -1: the check
    itself failed (on some rank)."""
    if not hasattr(dataset, "check_samples"):
        return {}
    try:
        mine = dataset.check_samples(range(ctx.rank, len(dataset), ctx.world_size))
    except Exception as error:  # noqa: BLE001 - a broken check must reach every rank, not hang them
        mine = {-1: f"check_samples failed on rank {ctx.rank}: {type(error).__name__}: {error}"}
    everyone = [mine]
    if ctx.world_size > 1:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
    return dict(sorted(item for problems in everyone for item in problems.items()))


def describe_bad_samples(bad):
    return f"{len(bad)} bad sample{'s' if len(bad) > 1 else ''}"


def shown_problems(bad):
    """The first SHOWN_PROBLEMS problems, the rest counted."""
    shown = "; ".join(list(bad.values())[:SHOWN_PROBLEMS])
    return shown + (f"; and {len(bad) - SHOWN_PROBLEMS} more" if len(bad) > SHOWN_PROBLEMS else "")


def global_batch_size(cfg, ctx):
    """Samples of one optimizer step: every rank's micro-batches of it."""
    return cfg.batch_size * ctx.world_size * cfg.grad_accum_steps


def build_loaders(cfg, ctx, train_set, val_set):
    """The training loader (ShardedSampler) and the validation loader of this rank."""
    order = getattr(train_set, "epoch_order", None)
    sampler = ShardedSampler(len(train_set), global_batch_size(cfg, ctx), ctx.rank, ctx.world_size, cfg.seed, order)
    common = dict(
        batch_size=cfg.batch_size,
        collate_fn=collate,
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
