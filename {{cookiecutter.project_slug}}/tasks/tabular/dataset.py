"""Yours: the data, your own table (a CSV or Parquet file), or a synthetic task; and how to plug in
other data.

    python train.py --data_file table.csv --target species          # classes: text or integers
    python train.py --data_file houses.parquet --target price       # numbers: regression

Every column but the target (and --ignore_columns) is a numeric feature, standardised with the
training split's mean and standard deviation; those statistics and the label names go into every
checkpoint, so predict.py reads new rows the way training did. The table is read, checked, split
and standardised by ddp_utils/data/tables.py, the rows served a batch at a time by
ddp_utils/data/rows.py: neither needs editing for a table of your own.

A --data_file that is a URL (s3://bucket/prefix) or a folder with index.json is read in Parquet
shards (make_shards.py writes them from the table, ddp_utils/data/table_shards.py reads them;
docs/streaming.md): rows already split and standardised, the checkpoint's statistics and label
names from the shards' index.

To train on other data, return your Datasets from `build_datasets` (each item an
`(input, target)` pair) and add the knobs your data needs to DataConfig. The split across
ranks, per-rank seeding and exact evaluation (ddp_utils/data/loaders.py) work unchanged for any
map-style Dataset.
"""

from dataclasses import dataclass

import torch

from ddp_utils.data import mix_seed
from ddp_utils.data.rows import Rows
from ddp_utils.data.shards import is_sharded
from ddp_utils.data.table_shards import resolve_shards, table_shards
from ddp_utils.data.tables import resolve_table, table_datasets
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob

# The synthetic data's sizes, where a field is left at 0.
SYNTHETIC = {"train_samples": 16384, "val_samples": 2048, "input_dim": 32, "num_classes": 4}


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_file: str = knob(
        "",
        "a CSV or Parquet table to train on (.csv, .parquet), or its shards: a URL or folder (make_shards.py); "
        "'' = the synthetic --dataset",
    )
    target: str = knob("", "the column of --data_file to predict")
    target_kind: str = knob(
        "auto",
        "auto: a target of text or whole numbers is class labels, other numbers are regression",
        ("auto", "classes", "regression"),
    )
    ignore_columns: str = knob("", "columns of --data_file that are not features (ids, free text), comma-separated")
    val_file: str = knob("", "a table with the validation rows; '' = hold out --val_fraction of --data_file")
    val_fraction: float = knob(0.1, "share of --data_file's rows held out for validation (of each class; from --seed)")
    dataset: str = knob(
        "synthetic",
        "without --data_file: which dataset build_datasets makes (regression: one real-valued target per sample)",
        ("synthetic", "blobs", "regression"),
    )
    train_samples: int = knob(0, "training samples, 0 = all (synthetic data: 16384); else the first N of the split")
    val_samples: int = knob(0, "validation samples, 0 = all (synthetic data: 2048); all of them are evaluated, once")
    input_dim: int = knob(0, "features per sample, 0 = the feature columns of --data_file (synthetic data: 32)")
    num_classes: int = knob(0, "classes, 0 = the labels of --target (synthetic data: 4)")
    input_noise_std: float = knob(0.0, "std of Gaussian noise added to training inputs, 0 = off")

    def check_data(self):
        for name in ("train_samples", "val_samples", "input_dim", "num_classes"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if self.num_classes == 1:
            raise ConfigError("num_classes", "must be 0 (from the data) or at least 2")
        if self.input_noise_std < 0:
            raise ConfigError("input_noise_std", "must not be negative")
        if not 0 < self.val_fraction < 1:
            raise ConfigError("val_fraction", "must be greater than 0 and less than 1")
        if not self.data_file:
            for name in ("target", "ignore_columns", "val_file"):
                if getattr(self, name):
                    raise ConfigError(name, "needs --data_file (the synthetic data has no columns)")
            if self.target_kind != "auto" and (self.target_kind == "regression") != (self.dataset == "regression"):
                raise ConfigError("target_kind", f"does not apply to the synthetic data: use --dataset {self.dataset}")
            return
        if self.dataset != "synthetic":
            raise ConfigError("dataset", "chooses the synthetic data: leave it out with --data_file")
        if is_sharded(self.data_file):
            if self.val_file:
                raise ConfigError("val_file", "does not apply to shards: make_shards.py wrote their validation rows")
            return  # the rest is the index's (resolve_shards)
        if not self.target:
            raise ConfigError("target", "is needed with --data_file: the column to predict")

    def resolve_data(self):
        """Sizes and the kind of target, from --data_file's columns (or the synthetic sizes)."""
        if self.data_file:
            return resolve_shards(self) if is_sharded(self.data_file) else resolve_table(self)
        sizes = {name: getattr(self, name) or value for name, value in SYNTHETIC.items()}
        return {**sizes, "target_kind": "regression" if self.dataset == "regression" else "classes"}


def build_datasets(cfg):
    """Plug in your own data here: return (train_dataset, val_dataset)."""
    if cfg.data_file:
        return table_shards(cfg) if is_sharded(cfg.data_file) else table_datasets(cfg)
    shape = dict(input_dim=cfg.input_dim, num_classes=cfg.num_classes, seed=cfg.seed)
    if cfg.dataset == "blobs":
        train = GaussianBlobs(cfg.train_samples, split="train", **shape)
        return train, GaussianBlobs(cfg.val_samples, split="val", **shape)
    shape["regression"] = cfg.dataset == "regression"
    train = SyntheticClassification(cfg.train_samples, split="train", noise_std=cfg.input_noise_std, **shape)
    val = SyntheticClassification(cfg.val_samples, split="val", **shape)
    return train, val


class SyntheticClassification(Rows):
    """Gaussian inputs labelled by a fixed random two-layer network: learnable but not linear.
    Deterministic from `seed` (train and val share the labelling network, not the samples)."""

    def __init__(self, num_samples, input_dim, num_classes, seed, split, noise_std=0.0, regression=False):
        teacher = torch.Generator().manual_seed(mix_seed(seed, "teacher"))
        hidden = torch.randn(input_dim, 8 * num_classes, generator=teacher) / input_dim**0.5
        readout = torch.randn(8 * num_classes, num_classes, generator=teacher)
        samples = torch.Generator().manual_seed(mix_seed(seed, split))
        inputs = torch.randn(num_samples, input_dim, generator=samples)
        outputs = torch.tanh(inputs @ hidden) @ readout
        # Regression: the network's first output, a real number (float targets: model.py's
        # loss is then the mean squared error); else the index of its largest output.
        super().__init__(inputs, outputs[:, 0] if regression else outputs.argmax(dim=1), seed, noise_std)


class GaussianBlobs(Rows):
    """A second, simpler task: one Gaussian cluster per class (docs/your-model.md's worked example of
    plugging in a dataset). Its rows are tensors in memory, so Rows serves them a batch at a
    time; any map-style Dataset of (input, target) pairs works too, a sample at a time."""

    def __init__(self, num_samples, input_dim, num_classes, seed, split):
        centers = torch.randn(num_classes, input_dim, generator=torch.Generator().manual_seed(mix_seed(seed, "blobs")))
        samples = torch.Generator().manual_seed(mix_seed(seed, "blobs", split))
        targets = torch.randint(num_classes, (num_samples,), generator=samples)
        super().__init__(centers[targets] + 0.5 * torch.randn(num_samples, input_dim, generator=samples), targets, seed)
