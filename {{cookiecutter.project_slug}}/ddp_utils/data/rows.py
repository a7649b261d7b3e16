"""Samples held in memory as tensors, a row each, served a whole batch at a time: one gather
per batch, and optional Gaussian input noise drawn from (seed, epoch, index).

A task whose data fits in memory hands its `(inputs, targets)` tensors to `Rows` (the tabular
task's synthetic data and your table alike, ddp_utils/data/tables.py): the loaders then take
each batch as one index operation, with no Python call and no collation per sample.
"""

import numpy as np
import torch
from torch.utils.data import Dataset

from .loaders import Batch, mix_seed


class Rows(Dataset):
    """(input row, target) pairs held in memory: the synthetic data and your table alike.

    With `noise_std > 0` the inputs get fresh Gaussian noise every epoch (training), a function
    of (seed, epoch, index) so it is the same whichever rank or worker loads the sample: a
    resumed run or another world size sees exactly the same data. It is drawn for a whole
    batch at once (gaussian_noise).
    """

    def __init__(self, inputs, targets, seed=0, noise_std=0.0):
        self.inputs, self.targets = inputs, targets
        self.seed, self.noise_std = seed, noise_std
        # Shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and still see the epoch the main process sets.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        """A whole batch with one gather, and its noise drawn at once, instead of a Python call
        per sample (DataLoader uses it). A Batch: the training loader takes it as it is, with
        no collation sample by sample."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        inputs = self.inputs[index]
        if self.noise_std > 0:
            key = mix_seed(self.seed, "noise", int(self.epoch))
            inputs = inputs + self.noise_std * gaussian_noise(key, index, inputs.shape[1])
        return Batch(inputs, self.targets[index])


def gaussian_noise(key, indices, width):
    """Standard normal noise, a row of `width` values per sample index: each value a function of
    (key, index, position) only, the same whichever batch, rank or worker draws it. A counter-
    based generator (splitmix64 of the counter, then Box-Muller), vectorised over the batch:
    no generator object or hash per sample."""
    counters = indices.numpy().astype(np.uint64)[:, None] * np.uint64(2 * width) + np.arange(2 * width, dtype=np.uint64)
    bits = _splitmix64(counters + np.uint64(key))
    uniform = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    radius = np.sqrt(-2.0 * np.log1p(-uniform[:, :width]))  # log1p(-u): u = 0 is fine, 1 never comes
    return torch.from_numpy(radius * np.cos(2 * np.pi * uniform[:, width:])).to(torch.float32)


def _splitmix64(x):
    """Steele et al.'s SplitMix64 output function on uint64 arrays (arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
