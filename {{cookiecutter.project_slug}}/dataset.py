"""Data: the built-in synthetic task, the split across ranks, and seeding.

To train on your own data, return your Datasets from `build_datasets` (each item an
`(input, target)` pair). The sampler, per-rank seeding and exact evaluation below work
unchanged for any map-style Dataset.
"""

import hashlib
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def mix_seed(*parts):
    """A 63-bit seed derived from any values, e.g. (seed, rank, epoch); distinct inputs never
    collide the way `seed + rank` does (seed 1, rank 0 == seed 0, rank 1)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class SyntheticClassification(Dataset):
    """Gaussian inputs labelled by a fixed random two-layer network: learnable but not linear.

    Deterministic from `seed` (train and val share the labelling network, not the samples).
    With `noise_std > 0` training inputs get fresh Gaussian noise every epoch, drawn from
    (seed, epoch, index) so it is the same whichever rank or worker loads the sample: a
    resumed run or another world size sees exactly the same data.
    """

    def __init__(self, num_samples, input_dim, num_classes, seed, split, noise_std=0.0):
        teacher = torch.Generator().manual_seed(mix_seed(seed, "teacher"))
        hidden = torch.randn(input_dim, 8 * num_classes, generator=teacher) / input_dim**0.5
        readout = torch.randn(8 * num_classes, num_classes, generator=teacher)
        samples = torch.Generator().manual_seed(mix_seed(seed, split))
        self.inputs = torch.randn(num_samples, input_dim, generator=samples)
        self.targets = (torch.tanh(self.inputs @ hidden) @ readout).argmax(dim=1)
        self.seed, self.noise_std = seed, noise_std
        # Shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and still see the epoch the main process sets.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        inputs = self.inputs[index]
        if self.noise_std > 0:
            noise = torch.Generator().manual_seed(mix_seed(self.seed, int(self.epoch), index))
            inputs = inputs + self.noise_std * torch.randn(inputs.shape, generator=noise)
        return inputs, self.targets[index]

    def __getitems__(self, indices):
        """A whole batch with one gather instead of a Python call per sample (DataLoader uses it)."""
        if self.noise_std > 0:
            return [self[index] for index in indices]
        index = torch.as_tensor(indices)
        return list(zip(self.inputs[index].unbind(), self.targets[index].unbind()))


class GaussianBlobs(Dataset):
    """A second, simpler task: one Gaussian cluster per class (the README's worked example of
    plugging in a dataset). Any map-style Dataset of (input, target) pairs works the same way."""

    def __init__(self, num_samples, input_dim, num_classes, seed, split):
        centers = torch.randn(num_classes, input_dim, generator=torch.Generator().manual_seed(mix_seed(seed, "blobs")))
        samples = torch.Generator().manual_seed(mix_seed(seed, "blobs", split))
        self.targets = torch.randint(num_classes, (num_samples,), generator=samples)
        self.inputs = centers[self.targets] + 0.5 * torch.randn(num_samples, input_dim, generator=samples)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


def build_datasets(cfg):
    """Plug in your own data here: return (train_dataset, val_dataset) for `cfg.dataset`."""
    shape = dict(input_dim=cfg.input_dim, num_classes=cfg.num_classes, seed=cfg.seed)
    if cfg.dataset == "blobs":
        train = GaussianBlobs(cfg.train_samples, split="train", **shape)
        return train, GaussianBlobs(cfg.val_samples, split="val", **shape)
    train = SyntheticClassification(cfg.train_samples, split="train", noise_std=cfg.input_noise_std, **shape)
    val = SyntheticClassification(cfg.val_samples, split="val", **shape)
    return train, val


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


def build_loaders(cfg, ctx):
    train_set, val_set = build_datasets(cfg)
    global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum_steps
    sampler = ShardedSampler(len(train_set), global_batch, ctx.rank, ctx.world_size, cfg.seed)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        pin_memory=ctx.device.type == "cuda",  # page-locked buffers make non_blocking copies async
        persistent_workers=cfg.num_workers > 0 and cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
    )
    # `start_epoch` seeds this generator from (seed, rank, epoch); from it torch seeds every
    # worker's torch, random and numpy generators with a distinct value per worker id (once
    # per epoch, or once per run with persistent workers). Augmentations then differ across
    # ranks and workers and repeat run to run; for exact mid-epoch resume, derive them from
    # (seed, epoch, index) like the built-in noise.
    train_loader = DataLoader(train_set, sampler=sampler, generator=torch.Generator(), **common)
    # Evaluation: every sample exactly once across ranks (ranks may get one sample more or
    # less than others; metrics are reduced as sums and counts, so that is exact). Its workers
    # are not kept between evaluations: they would hold memory through all of training.
    val_sampler = range(ctx.rank, len(val_set), ctx.world_size)
    val_loader = DataLoader(val_set, sampler=val_sampler, **{**common, "persistent_workers": False})
    return train_loader, val_loader


def start_epoch(loader, epoch, rank, seed, start=0):
    """Call before iterating `loader` in an epoch (also on resume): new order, new noise,
    newly seeded workers."""
    loader.sampler.set_epoch(epoch, start)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    loader.generator.manual_seed(mix_seed(seed, rank, epoch))
