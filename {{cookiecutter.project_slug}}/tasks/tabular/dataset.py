"""Yours: the data, your own table (a CSV or Parquet file), or a synthetic task; and how to plug in
other data.

    python train.py --data_file table.csv --target species          # classes: text or integers
    python train.py --data_file houses.parquet --target price       # numbers: regression

Every column but the target (and --ignore_columns) is a numeric feature. A validation split is
held out by --val_fraction (per class, from --seed), or comes from --val_file. Features are
standardised with the training split's mean and standard deviation (a regression target too);
those statistics and the label names go into every checkpoint (`Table.data_state`), so
predict.py reads new rows the way training did.

To train on other data, return your Datasets from `build_datasets` (each item an
`(input, target)` pair) and add the knobs your data needs to DataConfig. The split across
ranks, per-rank seeding and exact evaluation (ddp_utils/data/loaders.py) work unchanged for any map-style
Dataset.
"""

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_utils.data import Batch, mix_seed
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob

# The synthetic data's sizes, where a field is left at 0.
SYNTHETIC = {"train_samples": 16384, "val_samples": 2048, "input_dim": 32, "num_classes": 4}


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_file: str = knob("", "a CSV or Parquet table to train on (.csv, .parquet); '' = the synthetic --dataset")
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
        if not self.target:
            raise ConfigError("target", "is needed with --data_file: the column to predict")

    def resolve_data(self):
        """Sizes and the kind of target, from --data_file's columns (or the synthetic sizes)."""
        if not self.data_file:
            sizes = {name: getattr(self, name) or value for name, value in SYNTHETIC.items()}
            return {**sizes, "target_kind": "regression" if self.dataset == "regression" else "classes"}
        table = read_table(self.data_file, "data_file")
        columns = feature_columns(table, self)
        kind = target_kind(table, self)
        resolved = {"input_dim": len(columns), "target_kind": kind, "num_classes": 0}
        if kind == "classes":
            resolved["num_classes"] = len(label_names(table.labels(self.target)))
            if resolved["num_classes"] < 2:
                raise ConfigError("target", f"{self.target!r} of {self.data_file} has one class only")
        for name in ("input_dim", "num_classes"):
            given = getattr(self, name)
            if given and given != resolved[name]:
                raise ConfigError(name, f"is {given}, but --data_file {self.data_file} has {resolved[name]}")
        return resolved


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


class GaussianBlobs(Rows):
    """A second, simpler task: one Gaussian cluster per class (docs/your-model.md's worked example of
    plugging in a dataset). Its rows are tensors in memory, so Rows serves them a batch at a
    time; any map-style Dataset of (input, target) pairs works too, a sample at a time."""

    def __init__(self, num_samples, input_dim, num_classes, seed, split):
        centers = torch.randn(num_classes, input_dim, generator=torch.Generator().manual_seed(mix_seed(seed, "blobs")))
        samples = torch.Generator().manual_seed(mix_seed(seed, "blobs", split))
        targets = torch.randint(num_classes, (num_samples,), generator=samples)
        super().__init__(centers[targets] + 0.5 * torch.randn(num_samples, input_dim, generator=samples), targets, seed)


def build_datasets(cfg):
    """Plug in your own data here: return (train_dataset, val_dataset)."""
    if cfg.data_file:
        return table_datasets(cfg)
    shape = dict(input_dim=cfg.input_dim, num_classes=cfg.num_classes, seed=cfg.seed)
    if cfg.dataset == "blobs":
        train = GaussianBlobs(cfg.train_samples, split="train", **shape)
        return train, GaussianBlobs(cfg.val_samples, split="val", **shape)
    shape["regression"] = cfg.dataset == "regression"
    train = SyntheticClassification(cfg.train_samples, split="train", noise_std=cfg.input_noise_std, **shape)
    val = SyntheticClassification(cfg.val_samples, split="val", **shape)
    return train, val


# --- your own table -------------------------------------------------------------------------


class TableFile:
    """A table's columns by name, each a NumPy array (numbers, or text as objects). `flag` and
    `path` name it in errors. CSV: the first line names the columns."""

    def __init__(self, flag, path, columns):
        self.flag, self.path, self.columns = flag, path, columns
        self.rows = len(next(iter(columns.values()))) if columns else 0

    def error(self, problem):
        """A ConfigError that reads `--data_file PATH: problem`."""
        return ConfigError(self.flag, f"{self.path}: {problem}")

    def column(self, name):
        if name not in self.columns:
            raise self.error(f"no column {name!r} (columns: {', '.join(self.columns)})")
        return self.columns[name]

    def features(self, names, why):
        """Columns `names` side by side as float64 [rows, columns]; `why` explains a bad value."""
        return np.stack([self.numbers(name, why) for name in names], axis=1)

    def numbers(self, name, why):
        """Column `name` as float64, or an error naming the column and its first bad row."""
        values = self.column(name)
        try:
            numbers = values.astype(np.float64)  # every value a number (or a number's text)
        except (TypeError, ValueError):  # find the first that is not, for the error
            numbers = np.empty(len(values), dtype=np.float64)
            for row, value in enumerate(values):
                try:
                    numbers[row] = float(value)
                except (TypeError, ValueError):
                    raise self.error(f"column {name!r} {describe(value)} in data row {row + 1}: {why}") from None
        bad = np.flatnonzero(~np.isfinite(numbers))
        if len(bad):
            raise self.error(f"column {name!r} {describe(values[bad[0]])} in data row {bad[0] + 1}: {why}")
        return numbers

    def labels(self, name):
        """Column `name` as label text (whole numbers without a trailing .0); an empty cell is an
        error naming its row."""
        text = []
        for row, value in enumerate(self.column(name)):
            if is_missing(value):
                raise self.error(f"column {name!r} is empty in data row {row + 1}: every row needs its label")
            is_whole = isinstance(value, (float, np.floating)) and value == int(value)
            text.append(str(int(value)) if is_whole else str(value).strip())
        return np.array(text, dtype=object)


def is_missing(value):
    """An empty cell: nothing, blank text, or a float NaN (Parquet's and pandas' missing value)."""
    if isinstance(value, (float, np.floating)):
        return not np.isfinite(value)
    return value is None or str(value).strip() == ""


def describe(value):
    if is_missing(value):
        return "is empty" if value is None or str(value).strip() == "" else f"is {value}"
    return f"holds text ({str(value)!r})"


_read_tables = {}  # (path, size, mtime): TableFile, so resolving the config and building the data read it once


def read_table(path, flag):
    """The table at `path` (.csv, .parquet), or a ConfigError naming --flag and the file."""
    try:
        stat = os.stat(path)
    except OSError as error:
        raise ConfigError(flag, f"{path}: cannot read it ({error.strerror})") from None
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _read_tables:
        suffix = Path(path).suffix.lower()
        if suffix == ".csv":
            columns = read_csv(path, flag)
        elif suffix in (".parquet", ".pq"):
            columns = read_parquet(path, flag)
        else:
            raise ConfigError(flag, f"{path}: not a .csv or .parquet file")
        table = TableFile(flag, path, columns)
        if table.rows == 0:
            raise table.error("no data rows")
        if len(_read_tables) > 1:  # --data_file and --val_file: nothing older is read again
            _read_tables.clear()
        _read_tables[key] = table
    return _read_tables[key]


def read_csv(path, flag):
    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
        try:
            rows = list(csv.reader(f))
        except (csv.Error, UnicodeDecodeError) as error:
            raise ConfigError(flag, f"{path} is not a readable CSV file ({error})") from None
    rows = [row for row in rows if row]  # blank lines
    if not rows:
        raise ConfigError(flag, f"{path} is empty: the first line must name the columns")
    header = [name.strip() for name in rows[0]]
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated or "" in header:
        raise ConfigError(flag, f"{path}: the first line must name every column once ({duplicated or 'an empty name'})")
    for number, row in enumerate(rows[1:], start=1):
        if len(row) != len(header):
            raise ConfigError(flag, f"{path}: data row {number} has {len(row)} fields, the header {len(header)}")
    return {name: np.array([row[i] for row in rows[1:]], dtype=object) for i, name in enumerate(header)}


def read_parquet(path, flag):
    try:
        import pyarrow.parquet  # only for Parquet files: pip install pyarrow
    except ImportError:
        raise ConfigError(flag, f"{path} is a Parquet file, which needs pyarrow: pip install pyarrow") from None
    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as error:  # noqa: BLE001 - pyarrow's errors have no common base
        raise ConfigError(flag, f"{path} is not a readable Parquet file ({error})") from None
    columns = {}
    for name in table.column_names:
        values = table.column(name).to_numpy(zero_copy_only=False)
        columns[name] = values if values.dtype.kind in "biuf" else values.astype(object)
    return columns


def feature_columns(table, cfg):
    """The feature columns: every column but the target and --ignore_columns."""
    ignored = [name.strip() for name in cfg.ignore_columns.split(",") if name.strip()]
    for flag, names in (("target", [cfg.target]), ("ignore_columns", ignored)):
        for name in set(names) - set(table.columns):
            raise ConfigError(flag, f"{name!r} is not a column of {table.path} (columns: {', '.join(table.columns)})")
    columns = [name for name in table.columns if name != cfg.target and name not in ignored]
    if not columns:
        raise ConfigError("data_file", f"{cfg.data_file} has no feature columns besides --target and --ignore_columns")
    return columns


def target_kind(table, cfg):
    """classes or regression (auto: text and whole numbers are labels, other numbers are not)."""
    if cfg.target_kind != "auto":
        return cfg.target_kind
    values = table.column(cfg.target)
    if values.dtype.kind in "biu":
        return "classes"
    try:
        numbers = values.astype(np.float64)
    except (TypeError, ValueError):
        return "classes"  # text
    return "classes" if np.all(numbers == np.round(numbers)) else "regression"


def label_names(labels):
    """The sorted label texts: numerically when they are all numbers, else as text."""
    names = set(labels.tolist())
    try:
        return sorted(names, key=float)
    except ValueError:
        return sorted(names)


def split_rows(labels, rows, fraction, seed):
    """(train rows, validation rows): `fraction` of each class's rows held out (one class for
    regression), at least one left for training; a pure function of the rows and the seed."""
    generator = np.random.default_rng(mix_seed(seed, "validation split"))
    train, val = [], []
    groups = [np.arange(rows)] if labels is None else [np.flatnonzero(labels == label) for label in np.unique(labels)]
    for group in groups:
        group = generator.permutation(group)
        held_out = min(round(len(group) * fraction), len(group) - 1)
        val.append(group[:held_out])
        train.append(group[held_out:])
    return generator.permutation(np.concatenate(train)), np.sort(np.concatenate(val))


def table_datasets(cfg):
    """(train, val) Tables from --data_file (and --val_file); statistics from the training rows."""
    table = read_table(cfg.data_file, "data_file")
    columns = feature_columns(table, cfg)
    inputs, targets = table_arrays(table, columns, cfg)
    classes = cfg.target_kind == "classes"
    if cfg.val_file:
        train_rows = np.arange(table.rows)
    else:
        train_rows, val_rows = split_rows(targets if classes else None, table.rows, cfg.val_fraction, cfg.seed)
        if len(val_rows) == 0:
            raise ConfigError("val_fraction", f"holds out none of the {table.rows} rows of {cfg.data_file}")
    train_rows = first(train_rows, cfg.train_samples, "train_samples")
    state = {"features": columns, "target": cfg.target, "target_kind": cfg.target_kind}
    state["mean"], state["std"] = statistics(inputs[train_rows])
    if classes:
        state["classes"] = label_names(targets)  # every label of --data_file: num_classes counted them
    else:
        (state["target_mean"],), (state["target_std"],) = statistics(targets[train_rows, None])
    train = Table(inputs[train_rows], targets[train_rows], state, cfg.seed, cfg.input_noise_std)
    if cfg.val_file:
        table = read_table(cfg.val_file, "val_file")
        inputs, targets = table_arrays(table, columns, cfg)
        val_rows = np.arange(table.rows)
    val_rows = first(val_rows, cfg.val_samples, "val_samples")
    return train, Table(inputs[val_rows], targets[val_rows], state, source=table)


def table_arrays(table, columns, cfg):
    """(features [rows, columns] float64, targets: label texts or float64 numbers) of a table."""
    inputs = table.features(columns, "features must be numbers: fill in or drop the value, or list the column in "
                                     "--ignore_columns")  # fmt: skip
    if cfg.target_kind == "classes":
        return inputs, table.labels(cfg.target)
    return inputs, table.numbers(cfg.target, "a regression target must be a number (else --target_kind classes)")


def first(rows, count, flag):
    """The first `count` rows (0 = all)."""
    if count > len(rows):
        raise ConfigError(flag, f"is {count} but the split has {len(rows)} rows")
    return rows[:count] if count else rows


def statistics(values):
    """Per-column mean and standard deviation (1 where a column is constant), as lists."""
    mean, std = values.mean(axis=0), values.std(axis=0)
    return mean.tolist(), np.where(std > 0, std, 1.0).tolist()


def standardise(inputs, state):
    """Features as the model sees them: (x - mean) / std of the training rows, float32."""
    return torch.from_numpy((inputs - np.array(state["mean"])) / np.array(state["std"])).float()


class Table(Rows):
    """Standardised feature rows of a table, and their targets: class indices (the label names
    in data_state) or standardised numbers."""

    def __init__(self, inputs, targets, state, seed=0, noise_std=0.0, source=None):
        if "classes" in state:
            index = {name: i for i, name in enumerate(state["classes"])}
            unknown = sorted(set(targets.tolist()) - set(index))
            if unknown:  # only in --val_file: the split of --data_file keeps every label for training
                raise source.error(f"label {unknown[0]!r} is not one of --data_file's ({', '.join(index)})")
            targets = torch.tensor([index[label] for label in targets.tolist()], dtype=torch.int64)
        else:
            targets = torch.from_numpy((targets - state["target_mean"]) / state["target_std"]).float()
        super().__init__(standardise(inputs, state), targets, seed, noise_std)
        self.state = state

    def data_state(self):
        """What predict.py needs from the training rows, saved in every checkpoint."""
        return self.state
