"""Yours to run: turn a table into Parquet shards, in a folder or a bucket, for training that
streams its data (docs/streaming.md).

    python make_shards.py --data_file table.csv --target species --output_dir s3://my-bucket/table-v1
    python make_shards.py --data_file houses.parquet --target price --output_dir shards/houses --shard_mb 256
    python train.py --data_file s3://my-bucket/table-v1

The table's flags are train.py's (--target, --ignore_columns, --val_file, --val_fraction,
--train_samples, --val_samples, --seed, or a --config file): the shards hold the training and
validation rows that training on the table would read, split and standardised, and their index
the statistics and label names predict.py needs. The table itself is read as training reads it
(whole); the shards are written one at a time, index.json last: a write cut short leaves no
dataset, and the same command starts again into a new place.
"""

import sys

import numpy as np

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.data.shards import ShardWriter, is_sharded, shown, write_or_exit
from ddp_utils.data.tables import table_datasets
from ddp_utils.errors import InputError
from ddp_utils.knobs import OneLineParser, exit_with_error


def parquet_bytes(inputs, targets):
    """One shard: `x`, each row's features as a fixed-size list of float32, and `y`, the target."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet  # noqa: PLC0415

    width = inputs.shape[1]
    table = pa.table({
        "x": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(inputs).reshape(-1)), width),
        "y": pa.array(targets),
    })  # fmt: skip
    sink = pa.BufferOutputStream()
    pyarrow.parquet.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def write_shards(cfg, output_dir, shard_mb):
    if not cfg.data_file:
        raise InputError("--data_file is needed: the table to write as shards")
    if is_sharded(cfg.data_file):
        raise InputError(f"--data_file {shown(cfg.data_file)} is shards already")
    train, val = table_datasets(cfg)
    state = train.data_state()
    width = train.inputs.shape[1]
    per_shard = max(1, int(shard_mb * 2**20) // (4 * width + 8))  # rows: float32 features, an 8-byte target
    writer = ShardWriter(output_dir)
    for split, rows in (("train", train), ("val", val)):
        for start in range(0, len(rows), per_shard):
            inputs = rows.inputs[start : start + per_shard].numpy()
            writer.add(split, parquet_bytes(inputs, rows.targets[start : start + per_shard].numpy()), len(inputs),
                       suffix=".parquet")  # fmt: skip
    classes = len(state.get("classes", ()))
    facts = {"kind": "rows", "input_dim": width, "num_classes": classes, "ignore_columns": cfg.ignore_columns}
    return writer.close({**facts, "data_state": state})


def main():
    # Our two flags; every other is train.py's (python make_shards.py --help lists them).
    parser = OneLineParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--output_dir", required="-h" not in sys.argv and "--help" not in sys.argv)
    parser.add_argument("--shard_mb", type=float, default=64.0)
    args, rest = parser.parse_known_args()
    if args.shard_mb <= 0:
        exit_with_error(f"--shard_mb must be greater than 0, got {args.shard_mb}")
    if "-h" in rest or "--help" in rest:
        print("make_shards.py --output_dir DIR_OR_URL [--shard_mb MiB, default 64] and train.py's data flags:\n")
    cfg = parse_config(Config, rest)
    write_or_exit(args.output_dir, lambda: write_shards(cfg, args.output_dir, args.shard_mb))


if __name__ == "__main__":
    main()
