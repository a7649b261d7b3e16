"""A table of your own (a CSV or Parquet file) as training and validation rows: read, checked,
split and standardised; each bad value is one line naming the file, the column and the row.

Every column but the target (and --ignore_columns) is a numeric feature. A validation split is
held out by --val_fraction (per class, from --seed), or comes from --val_file. Features are
standardised with the training split's mean and standard deviation (a regression target too);
those statistics and the label names go into every checkpoint (`Table.data_state`), so
predict.py reads new rows the way training did.

The table's knobs are the tabular task's DataConfig fields (dataset.py), read here by name:
data_file, target, target_kind, ignore_columns, val_file, val_fraction, train_samples,
val_samples, input_dim, num_classes and input_noise_std, besides --seed.

A --data_file that is a URL (s3://bucket/prefix) or a folder with index.json names Parquet shards
of those rows, already split and standardised (the tabular task's make_shards.py writes them):
`RowShards` streams them through ddp_utils/data/shards.py, their index holding the sizes and the
checkpoint's data state.
"""

import csv
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .loaders import Batch, mix_seed
from .rows import Rows, gaussian_noise
from .shards import ShardedDataset, ShardStore, check_cache, read_index, shown


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


def resolve_table(cfg):
    """{input_dim, target_kind, num_classes} from --data_file's columns (DataConfig.resolve_data);
    an --input_dim or --num_classes given that disagrees with the table is an error."""
    table = read_table(cfg.data_file, "data_file")
    columns = feature_columns(table, cfg)
    kind = target_kind(table, cfg)
    resolved = {"input_dim": len(columns), "target_kind": kind, "num_classes": 0}
    if kind == "classes":
        resolved["num_classes"] = len(label_names(table.labels(cfg.target)))
        if resolved["num_classes"] < 2:
            raise ConfigError("target", f"{cfg.target!r} of {cfg.data_file} has one class only")
    for name in ("input_dim", "num_classes"):
        given = getattr(cfg, name)
        if given and given != resolved[name]:
            raise ConfigError(name, f"is {given}, but --data_file {cfg.data_file} has {resolved[name]}")
    return resolved


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


# --- shards --------------------------------------------------------------------------------


def as_data_file(error):
    """shards.py's errors name --data_dir, the other tasks' flag: here it is --data_file."""
    return ConfigError("data_file", error.problem) if error.field == "data_dir" else error


def shard_index(cfg):
    """The index of the row shards at --data_file, checked to be a table's."""
    try:
        index = read_index(cfg.data_file)
    except ConfigError as error:
        raise as_data_file(error) from None
    if index.get("kind") != "rows":
        raise ConfigError("data_file", f"{shown(cfg.data_file)} holds {index.get('kind')} shards, not rows of a table")
    return index


def resolve_shards(cfg):
    """{input_dim, target_kind, num_classes} from the shards' index; the flags that chose the
    columns when the shards were written must agree with it, or be left out."""
    index = shard_index(cfg)
    state = index["data_state"]
    made = {"target": state["target"], "ignore_columns": index["ignore_columns"]}
    for name, value in made.items():
        if getattr(cfg, name) and getattr(cfg, name) != value:
            raise ConfigError(name, f"is {getattr(cfg, name)!r}, but the shards of {shown(cfg.data_file)} were "
                                    f"written with {value!r}: leave it out, or write shards with it")  # fmt: skip
    resolved = {
        "input_dim": index["input_dim"],
        "target_kind": state["target_kind"],
        "num_classes": index["num_classes"],
    }
    if cfg.target_kind not in ("auto", resolved["target_kind"]):
        raise ConfigError("target_kind", f"is {cfg.target_kind}, but the shards hold {resolved['target_kind']} targets")
    for name in ("input_dim", "num_classes"):
        given = getattr(cfg, name)
        if given and given != resolved[name]:
            raise ConfigError(name, f"is {given}, but the shards of {shown(cfg.data_file)} have {resolved[name]}")
    return resolved


def first_of_shards(shards, count, flag, where):
    """(shards, samples of each) holding the first `count` samples of a split (0 = all)."""
    sizes = [shard["samples"] for shard in shards]
    if count > sum(sizes):
        raise ConfigError(flag, f"is {count} but the shards of {where} hold {sum(sizes)}")
    if not count:
        return shards, sizes
    kept = []
    for size in sizes:
        if count <= 0:
            break
        kept.append(min(size, count))
        count -= kept[-1]
    return shards[: len(kept)], kept


def table_shards(cfg):
    """(train, val) RowShards from the shards at --data_file, through the node's cache."""
    cache = cfg.stream_cache_dir or Path(tempfile.gettempdir()) / "ddp-shards"
    try:
        store = ShardStore(cfg.data_file, cache, cfg.stream_cache_gb)
    except ConfigError as error:
        raise as_data_file(error) from None
    train = RowShards(store, "train", cfg, cfg.train_samples, "train_samples", cfg.input_noise_std)
    return train, RowShards(store, "val", cfg, cfg.val_samples, "val_samples")


class RowShards(ShardedDataset):
    """The rows of Parquet shards (a fixed-size list column `x` of standardised features, and `y`:
    class indices or standardised numbers), as Table serves them: a batch at a time, with the
    same input noise drawn from (seed, epoch, index)."""

    def __init__(self, store, split, cfg, count, flag, noise_std=0.0):
        shards, sizes = first_of_shards(store.split(split), count, flag, shown(cfg.data_file))
        check_cache(cfg, shards)
        super().__init__(store, shards, sizes, cfg.stream_shuffle_shards)
        self.state, self.seed, self.noise_std = store.index["data_state"], cfg.seed, noise_std
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # seen by persistent workers

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def data_state(self):
        """What predict.py needs, as make_shards.py took it from the training rows."""
        return self.state

    def open_shard(self, path):
        import pyarrow.parquet  # noqa: PLC0415 - only for shards

        table = pyarrow.parquet.read_table(path)
        x = table.column("x").combine_chunks()
        inputs = x.flatten().to_numpy().reshape(len(x), x.type.list_size)
        return torch.from_numpy(inputs.copy()), torch.from_numpy(table.column("y").to_numpy().copy())

    def read(self, opened, j):
        return opened[0][j], opened[1][j]

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        rows = [super(RowShards, self).__getitem__(index) for index in indices]
        inputs, targets = torch.stack([row[0] for row in rows]), torch.stack([row[1] for row in rows])
        if self.noise_std > 0:
            key = mix_seed(self.seed, "noise", int(self.epoch))
            index = torch.as_tensor(indices, dtype=torch.int64)
            inputs = inputs + self.noise_std * gaussian_noise(key, index, inputs.shape[1])
        return Batch(inputs, targets)
