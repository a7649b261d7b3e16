"""The data: a synthetic tabular task, and how to plug in your own.

To train on your own data, return your Datasets from `build_datasets` (each item an
`(input, target)` pair) and add the knobs your data needs to DataConfig. The split across
ranks, per-rank seeding and exact evaluation (ddp_utils/data.py) work unchanged for any map-style
Dataset.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_utils.data import mix_seed
from ddp_utils.knobs import ConfigError, knob


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    dataset: str = knob(
        "synthetic",
        "which dataset build_datasets returns (regression: one real-valued target per sample)",
        ("synthetic", "blobs", "regression"),
    )
    train_samples: int = knob(16384, "training samples")
    val_samples: int = knob(2048, "validation samples (all of them are evaluated, once)")
    input_dim: int = knob(32, "features per sample")
    num_classes: int = knob(4, "classes")
    input_noise_std: float = knob(0.0, "std of Gaussian noise added to training inputs, 0 = off")

    def check_data(self):
        for name in ("train_samples", "val_samples", "input_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.num_classes < 2:
            raise ConfigError("num_classes", "must be at least 2")
        if self.input_noise_std < 0:
            raise ConfigError("input_noise_std", "must not be negative")

    def resolve_data(self):
        return {}


class SyntheticClassification(Dataset):
    """Gaussian inputs labelled by a fixed random two-layer network: learnable but not linear.

    Deterministic from `seed` (train and val share the labelling network, not the samples).
    With `noise_std > 0` training inputs get fresh Gaussian noise every epoch, a function of
    (seed, epoch, index) so it is the same whichever rank or worker loads the sample: a
    resumed run or another world size sees exactly the same data. It is drawn for a whole
    batch at once (gaussian_noise).
    """

    def __init__(self, num_samples, input_dim, num_classes, seed, split, noise_std=0.0, regression=False):
        teacher = torch.Generator().manual_seed(mix_seed(seed, "teacher"))
        hidden = torch.randn(input_dim, 8 * num_classes, generator=teacher) / input_dim**0.5
        readout = torch.randn(8 * num_classes, num_classes, generator=teacher)
        samples = torch.Generator().manual_seed(mix_seed(seed, split))
        self.inputs = torch.randn(num_samples, input_dim, generator=samples)
        outputs = torch.tanh(self.inputs @ hidden) @ readout
        # Regression: the network's first output, a real number (float targets: model.py's
        # loss is then the mean squared error); else the index of its largest output.
        self.targets = outputs[:, 0] if regression else outputs.argmax(dim=1)
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
        per sample (DataLoader uses it)."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        inputs = self.inputs[index]
        if self.noise_std > 0:
            key = mix_seed(self.seed, "noise", int(self.epoch))
            inputs = inputs + self.noise_std * gaussian_noise(key, index, inputs.shape[1])
        return list(zip(inputs.unbind(), self.targets[index].unbind()))


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
    shape["regression"] = cfg.dataset == "regression"
    train = SyntheticClassification(cfg.train_samples, split="train", noise_std=cfg.input_noise_std, **shape)
    val = SyntheticClassification(cfg.val_samples, split="val", **shape)
    return train, val
