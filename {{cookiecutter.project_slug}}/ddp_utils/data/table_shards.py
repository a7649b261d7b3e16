"""A table as Parquet shards: written from a CSV or Parquet file of any size (the tabular task's
make_shards.py), and read back as training rows from a folder or a bucket (a --data_file that is a
URL or a folder with index.json).

The shards hold exactly the rows table_datasets (tables.py) reads from the table: the same split,
the same order of training rows, standardised with the same statistics, to the bit. The writer
never holds the table: it reads it a chunk at a time, three times (the columns and the kind of
target, which rows go where, then the features), and sorts the rows into their shards through files
in --temp_dir. It keeps in memory a chunk, one shard (about 5 times its size on disk), and a few
numbers a row (its label's, its place's): 100 to 150 bytes, where the table read whole takes
several times its file's size.

Each shard is a Parquet file: `x`, a row's standardised features (a fixed-size list of float32),
and `y`, its class index or standardised number. The index holds the sizes and the checkpoint's
data state (feature columns, statistics, label names).
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..core.units import size_text
from ..errors import ConfigError, InputError
from .loaders import Batch, mix_seed
from .rows import gaussian_noise
from .shards import ShardedDataset, ShardWriter, check_cache, first_of_shards, is_sharded, open_store, read_index, shown
from .tables import (
    Moments,
    agreed,
    class_indices,
    data_state,
    feature_columns,
    label_names,
    split_table,
    standard_targets,
    standardise,
    table_chunks,
    table_features,
    target_values,
)

# --- writing -------------------------------------------------------------------------------


def write_table_shards(cfg, output_dir, shard_mb, temp_dir=None, say=print):
    """Write --data_file's rows (and --val_file's) as Parquet shards of about `shard_mb` MiB at
    `output_dir`, index.json last; returns the index. `cfg` is resolved (its target_kind known)."""
    if not cfg.data_file:
        raise InputError("--data_file is needed: the table to write as shards")
    if is_sharded(cfg.data_file):
        raise InputError(f"--data_file {shown(cfg.data_file)} is shards already")
    writer = ShardWriter(output_dir)  # a destination holding a dataset is refused before the table is read
    if temp_dir and not Path(temp_dir).is_dir():
        raise InputError(f"--temp_dir {temp_dir} is not a folder")
    classes = cfg.target_kind == "classes"

    say(f"reading {cfg.data_file}: its labels and rows")
    rows, codes, names, columns = 0, [], {}, None  # codes: each row's label, as its number in `names`
    for chunk in table_chunks(cfg.data_file, "data_file"):
        columns = columns or feature_columns(chunk, cfg)
        if classes:
            text, inverse = np.unique(chunk.labels(cfg.target), return_inverse=True)
            seen = np.array([names.setdefault(name, len(names)) for name in text.tolist()], dtype=np.int32)
            codes.append(seen[inverse])
        rows += chunk.rows
    codes = np.concatenate(codes) if classes else None
    # The split groups the rows by label text in sorted order (np.unique), as table_datasets does.
    by_text = np.argsort(np.argsort(np.array(list(names), dtype=object))).astype(np.int32) if classes else None
    train_rows, val_rows = split_table(cfg, by_text[codes] if classes else None, rows)
    place = np.full(rows, -1, dtype=np.int64)  # a training row's place in its split; -2 - place a validation row's
    place[train_rows] = np.arange(len(train_rows))
    if val_rows is not None:
        place[val_rows] = -2 - np.arange(len(val_rows))
    sizes = {"train": len(train_rows), "val": 0 if val_rows is None else len(val_rows)}
    del train_rows, val_rows

    width = len(columns)
    per_shard = max(1, int(shard_mb * 2**20) // (4 * width + 8))  # rows: float32 features, an 8-byte target
    target = label_names(np.array(list(names), dtype=object)) if classes else Moments()
    index_of = np.array([target.index(name) for name in names], dtype=np.int64) if classes else None
    with Buckets(temp_dir, width, classes, per_shard) as buckets:
        buckets.reserve(sizes["train"] + sizes["val"])
        say(f"reading {cfg.data_file}: its features, into shards by way of {buckets.folder}")
        moments, done = Moments(), 0
        for chunk in table_chunks(cfg.data_file, "data_file"):
            at, done = place[done : done + chunk.rows], done + chunk.rows
            inputs = table_features(chunk, columns)
            targets = index_of[codes[done - chunk.rows : done]] if classes else target_values(chunk, cfg)
            train, val = at >= 0, at <= -2
            moments.add(inputs[train])  # training rows, a chunk at a time in the file's order: as tables.chunkwise
            if not classes:
                target.add(targets[train, None])
            buckets.put("train", at[train], inputs[train], targets[train])
            buckets.put("val", -2 - at[val], inputs[val], targets[val])
        state = data_state(cfg, columns, moments, target)
        if cfg.val_file:
            sizes["val"] = val_file_rows(cfg, columns, state, buckets)

        for split, count in sizes.items():
            for shard, start in enumerate(range(0, count, per_shard)):
                records = buckets.take(split, shard, min(per_shard, count - start))
                inputs = standardise(records["x"], state).numpy()
                targets = records["y"] if classes else standard_targets(records["y"], state).numpy()
                writer.add(split, parquet_bytes(inputs, targets), len(records), suffix=".parquet")
    facts = {"kind": "rows", "input_dim": width, "num_classes": len(target) if classes else 0}
    return writer.close({**facts, "ignore_columns": cfg.ignore_columns, "data_state": state})


def val_file_rows(cfg, columns, state, buckets):
    """--val_file's first --val_samples rows (0 = all) into the validation shards; every row checked."""
    done = 0
    for chunk in table_chunks(cfg.val_file, "val_file"):
        kept = max(0, min(chunk.rows, cfg.val_samples - done)) if cfg.val_samples else chunk.rows
        inputs, targets = table_features(chunk, columns)[:kept], target_values(chunk, cfg)[:kept]
        if "classes" in state:
            targets = class_indices(targets, state, chunk)
        buckets.put("val", np.arange(done, done + kept), inputs, targets)
        done += chunk.rows
    if cfg.val_samples > done:
        raise ConfigError("val_samples", f"is {cfg.val_samples} but the split has {done} rows")
    return cfg.val_samples or done


class Buckets:
    """Rows sorted into their shards on local disk, a file per shard under --temp_dir (removed on
    leaving): `put` appends each row to the file of the shard its place falls in, `take` gives a
    shard's rows back in the order of their places."""

    def __init__(self, temp_dir, width, classes, per_shard):
        self.temp_dir, self.per_shard = temp_dir or tempfile.gettempdir(), per_shard
        y = np.int64 if classes else np.float64  # a class index, or the raw number (standardised when written)
        self.dtype = np.dtype([("at", np.int64), ("x", np.float64, (width,)), ("y", y)])
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="make-shards-", dir=self.temp_dir))
        except OSError as error:
            raise self.error(error) from None

    def __enter__(self):
        return self

    def __exit__(self, *failure):
        shutil.rmtree(self.folder, ignore_errors=True)

    def reserve(self, rows):
        """Refuse at once a --temp_dir without room for `rows` rows, rather than hours later."""
        needed, free = rows * self.dtype.itemsize, shutil.disk_usage(self.folder).free
        if free < needed:
            need = f"the table's rows need about {size_text(needed)} there to be sorted into their shards"
            raise InputError(f"--temp_dir {self.temp_dir} has {size_text(free)} free, but {need}: another, with room")

    def error(self, error):
        return InputError(f"--temp_dir {self.temp_dir}: {error.strerror or error}: the rows are sorted into "
                          "their shards there, as much as the table's features in float64")  # fmt: skip

    def put(self, split, at, inputs, targets):
        records = np.empty(len(at), self.dtype)
        records["at"], records["x"], records["y"] = at, inputs, targets
        shard = at // self.per_shard
        order = np.argsort(shard, kind="stable")
        records, shard = records[order], shard[order]
        edges = [*np.flatnonzero(np.diff(shard)) + 1, len(shard)]
        try:
            for start, end in zip([0, *edges[:-1]], edges):
                if end > start:
                    with open(self.folder / f"{split}-{shard[start]}", "ab") as f:
                        records[start:end].tofile(f)
        except OSError as error:
            raise self.error(error) from None

    def take(self, split, shard, count):
        path = self.folder / f"{split}-{shard}"
        records = np.fromfile(path, self.dtype) if path.exists() else np.empty(0, self.dtype)
        path.unlink(missing_ok=True)
        records = records[np.argsort(records["at"])]
        expected = np.arange(shard * self.per_shard, shard * self.per_shard + count)
        if not np.array_equal(records["at"], expected):  # a file changed under us: never write a wrong shard
            raise InputError(f"--temp_dir {self.temp_dir}: {path} lost rows while the shards were written")
        return records


def parquet_bytes(inputs, targets):
    """One shard: `x`, each row's features as a fixed-size list of float32, and `y`, the target."""
    import pyarrow as pa  # noqa: PLC0415 - only for shards
    import pyarrow.parquet  # noqa: PLC0415

    width = inputs.shape[1]
    table = pa.table({
        "x": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(inputs).reshape(-1)), width),
        "y": pa.array(targets),
    })  # fmt: skip
    sink = pa.BufferOutputStream()
    pyarrow.parquet.write_table(table, sink)
    return sink.getvalue().to_pybytes()


# --- reading -------------------------------------------------------------------------------


def shard_index(cfg):
    """The index of the row shards at --data_file, checked to be a table's."""
    index = read_index(cfg.data_file, "data_file")
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
    return agreed(cfg, resolved, f"the shards of {shown(cfg.data_file)} have")


def table_shards(cfg):
    """(train, val) RowShards from the shards at --data_file, through the node's cache."""
    store = open_store(cfg, "data_file")
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
