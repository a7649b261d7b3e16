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

A table is read a chunk of rows at a time (`table_chunks`): read whole for training
here, or streamed through, never whole, by table_shards.py, which writes the same rows as Parquet
shards (a --data_file that is a URL or a folder with index.json). The statistics are summed chunk
by chunk (`Moments`) on both paths, so both give the same rows to the bit.
"""

import csv
import itertools
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .loaders import mix_seed
from .rows import Rows

# Values (rows x columns) read at a time: a chunk is a few MB in memory, text and all.
CHUNK_VALUES = 2**18


def chunk_rows(columns):
    """Rows of a chunk of a table with `columns` columns: its statistics are summed a chunk at a time."""
    return max(64, CHUNK_VALUES // columns)


class TableFile:
    """A table's columns by name, each a NumPy array (numbers, or text as objects), or a chunk of
    them whose first row is data row `first_row + 1`. `flag` and `path` name it in errors."""

    def __init__(self, flag, path, columns, first_row=0):
        self.flag, self.path, self.columns, self.first_row = flag, path, columns, first_row
        self.rows = len(next(iter(columns.values()))) if columns else 0

    def error(self, problem):
        """A ConfigError that reads `--data_file PATH: problem`."""
        return ConfigError(self.flag, f"{self.path}: {problem}")

    def row(self, i):
        """Row i's number in the file's data rows, from 1 (as a spreadsheet shows it, less the header)."""
        return self.first_row + i + 1

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
                    raise self.error(f"column {name!r} {describe(value)} in data row {self.row(row)}: {why}") from None
        bad = np.flatnonzero(~np.isfinite(numbers))
        if len(bad):
            raise self.error(f"column {name!r} {describe(values[bad[0]])} in data row {self.row(bad[0])}: {why}")
        return numbers

    def labels(self, name):
        """Column `name` as label text (whole numbers without a trailing .0); an empty cell is an
        error naming its row."""
        text = []
        for row, value in enumerate(self.column(name)):
            if is_missing(value):
                raise self.error(f"column {name!r} is empty in data row {self.row(row)}: every row needs its label")
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


def read_table(path, flag):
    """The table at `path` (.csv, .parquet) whole, or a ConfigError naming --flag and the file."""
    chunks = list(table_chunks(path, flag))
    names = chunks[0].columns
    return TableFile(flag, path, {name: np.concatenate([chunk.columns[name] for chunk in chunks]) for name in names})


def table_chunks(path, flag):
    """The table at `path` (.csv, .parquet) as TableFiles of chunk_rows(its columns) rows (the last
    fewer), read as they are used; a file that cannot be read, or has no data rows, is a ConfigError naming --flag."""
    if not Path(path).is_file():
        raise ConfigError(flag, f"{path}: cannot read it (no such file)")
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        batches = csv_chunks(path, flag)
    elif suffix in (".parquet", ".pq"):
        batches = parquet_chunks(path, flag)
    else:
        raise ConfigError(flag, f"{path}: not a .csv or .parquet file")
    done = 0
    for columns in batches:
        chunk = TableFile(flag, path, columns, first_row=done)
        done += chunk.rows
        yield chunk
    if done == 0:
        raise ConfigError(flag, f"{path}: no data rows")


def csv_chunks(path, flag):
    """{column: text values} of chunk_rows() data rows at a time; the first line names the columns."""
    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
        rows = (row for row in csv.reader(f) if row)  # blank lines skipped
        try:
            header = [name.strip() for name in next(rows, [])]
            if not header:
                raise ConfigError(flag, f"{path} is empty: the first line must name the columns")
            duplicated = sorted({name for name in header if header.count(name) > 1})
            if duplicated or "" in header:
                problem = duplicated or "an empty name"
                raise ConfigError(flag, f"{path}: the first line must name every column once ({problem})")
            done = 0
            while chunk := list(itertools.islice(rows, chunk_rows(len(header)))):
                for number, row in enumerate(chunk, start=done + 1):
                    if len(row) != len(header):
                        problem = f"data row {number} has {len(row)} fields, the header {len(header)}"
                        raise ConfigError(flag, f"{path}: {problem}")
                done += len(chunk)
                yield {name: np.array([row[i] for row in chunk], dtype=object) for i, name in enumerate(header)}
        except (csv.Error, UnicodeDecodeError) as error:
            raise ConfigError(flag, f"{path} is not a readable CSV file ({error})") from None


def parquet_chunks(path, flag):
    """{column: values} of chunk_rows() rows at a time (numbers as numbers, the rest as objects)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # only for Parquet files: pip install pyarrow
    except ImportError:
        raise ConfigError(flag, f"{path} is a Parquet file, which needs pyarrow: pip install pyarrow") from None
    try:
        file = pyarrow.parquet.ParquetFile(path)
        size = chunk_rows(len(file.schema_arrow.names))
        held, count = [], 0  # a file's row groups end where they do: whole chunks are cut from what is read
        for batch in file.iter_batches(batch_size=size):
            held.append(batch)
            count += batch.num_rows
            while count >= size:
                table = pa.Table.from_batches(held)
                yield parquet_columns(table.slice(0, size))
                held, count = table.slice(size).to_batches(), count - size
        if count:
            yield parquet_columns(pa.Table.from_batches(held))
    except Exception as error:  # noqa: BLE001 - pyarrow's errors have no common base
        raise ConfigError(flag, f"{path} is not a readable Parquet file ({error})") from None


def parquet_columns(table):
    columns = {}
    for name in table.column_names:
        values = table.column(name).to_numpy()
        columns[name] = values if values.dtype.kind in "biuf" else values.astype(object)
    return columns


def resolve_table(cfg):
    """{input_dim, target_kind, num_classes} from --data_file's columns (DataConfig.resolve_data),
    read a chunk at a time; an --input_dim or --num_classes given that disagrees is an error."""
    columns, kinds, names, missed = None, set(), set(), False
    for chunk in table_chunks(cfg.data_file, "data_file"):
        columns = columns or feature_columns(chunk, cfg)
        kinds.add(cfg.target_kind if cfg.target_kind != "auto" else value_kind(chunk.column(cfg.target)))
        if kinds & {"regression", "fraction"}:
            missed = True  # numbers: labels only if text turns up later (then read again, below)
        else:
            names.update(chunk.labels(cfg.target).tolist())
    kind = target_kind(kinds, cfg)
    resolved = {"input_dim": len(columns), "target_kind": kind, "num_classes": 0}
    if kind == "classes":
        if missed:
            names = {name for chunk in table_chunks(cfg.data_file, "data_file") for name in chunk.labels(cfg.target)}
        resolved["num_classes"] = len(names)
        if resolved["num_classes"] < 2:
            raise ConfigError("target", f"{cfg.target!r} of {cfg.data_file} has one class only")
    return agreed(cfg, resolved, f"--data_file {cfg.data_file} has")


def agreed(cfg, resolved, source):
    """`resolved`, once an --input_dim and --num_classes given agree with it (0: not given);
    `source` says whose the sizes are, and its verb ("--data_file t.csv has")."""
    for name in ("input_dim", "num_classes"):
        given = getattr(cfg, name)
        if given and given != resolved[name]:
            raise ConfigError(name, f"is {given}, but {source} {resolved[name]}")
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


def value_kind(values):
    """text, whole (numbers) or fraction (other numbers): what a target column's values are."""
    if values.dtype.kind in "biu":
        return "whole"
    try:
        numbers = values.astype(np.float64)
    except (TypeError, ValueError):
        return "text"
    return "whole" if np.all(numbers == np.round(numbers)) else "fraction"


def target_kind(kinds, cfg):
    """classes or regression, from the value_kind of each chunk of the target column (auto: text
    and whole numbers are labels, other numbers are not)."""
    if cfg.target_kind != "auto":
        return cfg.target_kind
    return "regression" if "fraction" in kinds and "text" not in kinds else "classes"


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


def split_table(cfg, labels, rows):
    """(training rows, in training's order; validation rows of --data_file, or None with
    --val_file) of a table of `rows` rows; `labels`: each row's class (any codes that sort as the
    label texts do), or None for regression."""
    if cfg.val_file:
        return first(np.arange(rows), cfg.train_samples, "train_samples"), None
    train_rows, val_rows = split_rows(labels, rows, cfg.val_fraction, cfg.seed)
    if len(val_rows) == 0:
        raise ConfigError("val_fraction", f"holds out none of the {rows} rows of {cfg.data_file}")
    return first(train_rows, cfg.train_samples, "train_samples"), first(val_rows, cfg.val_samples, "val_samples")


def table_datasets(cfg):
    """(train, val) Tables from --data_file (and --val_file); statistics from the training rows."""
    table = read_table(cfg.data_file, "data_file")
    columns = feature_columns(table, cfg)
    inputs, targets = table_features(table, columns), target_values(table, cfg)
    classes = cfg.target_kind == "classes"
    train_rows, val_rows = split_table(cfg, targets if classes else None, table.rows)
    # every label of --data_file (num_classes counted them); or the target's statistics
    target = label_names(targets) if classes else chunkwise(targets[:, None], train_rows, len(table.columns))
    state = data_state(cfg, columns, chunkwise(inputs, train_rows, len(table.columns)), target)
    train = Table(inputs[train_rows], targets[train_rows], state, cfg.seed, cfg.input_noise_std)
    if val_rows is None:
        table = read_table(cfg.val_file, "val_file")
        inputs, targets = table_features(table, columns), target_values(table, cfg)
        val_rows = first(np.arange(table.rows), cfg.val_samples, "val_samples")
    return train, Table(inputs[val_rows], targets[val_rows], state, source=table)


def data_state(cfg, columns, moments, target):
    """What every checkpoint keeps of the table, for predict.py: the feature columns and their
    training rows' statistics (`moments`), and `target`: the label names, or the target's Moments."""
    state = {"features": columns, "target": cfg.target, "target_kind": cfg.target_kind}
    state["mean"], state["std"] = moments.statistics()
    if isinstance(target, Moments):
        (state["target_mean"],), (state["target_std"],) = target.statistics()
    else:
        state["classes"] = target
    return state


def table_features(table, columns):
    """The feature columns side by side: float64 [rows, columns]."""
    return table.features(columns, "features must be numbers: fill in or drop the value, or list the column in "
                                   "--ignore_columns")  # fmt: skip


def target_values(table, cfg):
    """The target column: label texts, or float64 numbers for regression."""
    if cfg.target_kind == "classes":
        return table.labels(cfg.target)
    return table.numbers(cfg.target, "a regression target must be a number (else --target_kind classes)")


def class_indices(labels, state, source):
    """Label texts as indices into the data state's label names; a label not among them (only in
    --val_file: the split of --data_file keeps every label for training) is an error naming `source`."""
    index = {name: i for i, name in enumerate(state["classes"])}
    unknown = sorted(set(labels.tolist()) - set(index))
    if unknown:
        raise source.error(f"label {unknown[0]!r} is not one of --data_file's ({', '.join(index)})")
    return np.array([index[label] for label in labels.tolist()], dtype=np.int64)


def standard_targets(targets, state):
    """Regression targets as the model sees them: standardised like the features, float32."""
    return torch.from_numpy((targets - state["target_mean"]) / state["target_std"]).float()


def first(rows, count, flag):
    """The first `count` rows (0 = all)."""
    if count > len(rows):
        raise ConfigError(flag, f"is {count} but the split has {len(rows)} rows")
    return rows[:count] if count else rows


class Moments:
    """Per-column count, mean and sum of squared deviations of rows added a chunk at a time (Chan
    et al.'s pairwise update): the same chunks in the same order give the same statistics to the
    bit, whether the table was read whole (chunkwise) or streamed (table_shards.py)."""

    def __init__(self):
        self.count, self.mean, self.m2, self.low, self.high = 0, 0.0, 0.0, np.inf, -np.inf

    def add(self, values):
        """Rows [n, columns] of float64: a chunk's training rows, in the file's order."""
        if not len(values):
            return
        count, mean = len(values), values.mean(axis=0)
        m2 = ((values - mean) ** 2).sum(axis=0)
        delta, total = mean - self.mean, self.count + count
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.mean = self.mean + delta * (count / total)
        self.count = total
        self.low, self.high = np.minimum(self.low, values.min(axis=0)), np.maximum(self.high, values.max(axis=0))

    def statistics(self):
        """(means, standard deviations) as lists; the deviation 1 where a column is constant."""
        std = np.sqrt(self.m2 / self.count)
        return self.mean.tolist(), np.where(self.high > self.low, std, 1.0).tolist()


def chunkwise(values, rows, columns):
    """Moments of `values[rows]` added as a streamed table of `columns` columns adds them: each
    chunk of the file's rows in turn, the selected rows of a chunk in the file's order."""
    moments, rows, size = Moments(), np.sort(rows), chunk_rows(columns)
    edges = np.searchsorted(rows, np.arange(0, len(values) + size, size))
    for start, end in itertools.pairwise(edges):
        moments.add(values[rows[start:end]])
    return moments


def standardise(inputs, state):
    """Features as the model sees them: (x - mean) / std of the training rows, float32."""
    return torch.from_numpy((inputs - np.array(state["mean"])) / np.array(state["std"])).float()


class Table(Rows):
    """Standardised feature rows of a table, and their targets: class indices (the label names
    in data_state) or standardised numbers."""

    def __init__(self, inputs, targets, state, seed=0, noise_std=0.0, source=None):
        if "classes" in state:
            targets = torch.from_numpy(class_indices(targets, state, source))
        else:
            targets = standard_targets(targets, state)
        super().__init__(standardise(inputs, state), targets, seed, noise_std)
        self.state = state

    def data_state(self):
        """What predict.py needs from the training rows, saved in every checkpoint."""
        return self.state
