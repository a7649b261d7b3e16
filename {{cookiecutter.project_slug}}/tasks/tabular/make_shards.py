"""Yours to run: turn a table into Parquet shards, in a folder or a bucket, for training that
streams its data (docs/streaming.md).

    python make_shards.py --data_file table.csv --target species --output_dir s3://my-bucket/table-v1
    python make_shards.py --data_file houses.parquet --target price --output_dir shards/houses --shard_mb 256
    python train.py --data_file s3://my-bucket/table-v1

The table's flags are train.py's (--target, --ignore_columns, --val_file, --val_fraction,
--train_samples, --val_samples, --seed, or a --config file): the shards hold the training and
validation rows that training on the table reads, split and standardised, and their index the
statistics and label names predict.py needs. A table of any size goes through: it is read a chunk
at a time, and its rows are sorted into their shards through files in --temp_dir (as much room as
the features take in float64). The shards are written one at a time, index.json last: a write cut
short leaves no dataset, and the same command starts again into a new place.
"""

import sys

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.data.shards import write_or_exit
from ddp_utils.data.table_shards import write_table_shards
from ddp_utils.knobs import OneLineParser, exit_with_error


def main():
    # Our flags; every other is train.py's (python make_shards.py --help lists them).
    parser = OneLineParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--output_dir", required="-h" not in sys.argv and "--help" not in sys.argv)
    parser.add_argument("--shard_mb", type=float, default=64.0)
    parser.add_argument("--temp_dir", default=None)
    args, rest = parser.parse_known_args()
    if args.shard_mb <= 0:
        exit_with_error(f"--shard_mb must be greater than 0, got {args.shard_mb}")
    if "-h" in rest or "--help" in rest:
        print("make_shards.py --output_dir DIR_OR_URL [--shard_mb MiB, default 64] [--temp_dir DIR, default the "
              "system's temporary folder] and train.py's data flags:\n")  # fmt: skip
    cfg = parse_config(Config, rest)
    write_or_exit(args.output_dir, lambda: write_table_shards(cfg, args.output_dir, args.shard_mb, args.temp_dir))


if __name__ == "__main__":
    main()
