"""Yours to run: turn the token files of a data folder into shards, in a folder or a bucket, for
training that streams its data (docs/streaming.md).

    python make_shards.py --output_dir s3://my-bucket/text-v1          # from data/text
    python make_shards.py --data_dir data/book --output_dir shards/book --shard_mb 256
    python train.py --data_dir s3://my-bucket/text-v1

The token files (prepare_data.py's train.bin, val.bin, meta.json) are read a shard at a time,
never whole, so a corpus of any size goes through. The shards are written first and index.json
last: a write cut short leaves no dataset, and the same command starts again into a new place.
The store's client takes its credentials from the environment as it always does.
"""

import argparse
from pathlib import Path

import numpy as np

from dataset import DEFAULT_DATA_DIR, token_file_meta
from ddp_utils.data.shards import ShardWriter, write_or_exit
from ddp_utils.errors import InputError
from ddp_utils.knobs import OneLineParser, exit_with_error


def write_shards(data_dir, output_dir, shard_mb):
    folder = Path(data_dir)
    meta = token_file_meta(folder)
    dtype = np.dtype(meta["dtype"])
    per_shard = max(2, int(shard_mb * 2**20) // dtype.itemsize)  # tokens
    writer = ShardWriter(output_dir)
    for split, name in (("train", "train.bin"), ("val", "val.bin")):
        path = folder / name
        if not path.is_file():
            raise InputError(f"{path} does not exist: run python prepare_data.py --output_dir {folder} first")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        # Consecutive shards share one token, so a window may end where the next shard begins.
        for start in range(0, max(1, len(tokens) - 1), per_shard):
            piece = np.ascontiguousarray(tokens[start : start + per_shard + 1])
            writer.add(split, piece.tobytes(), len(piece))
    return writer.close({"kind": "tokens", **meta})


def main():
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR, help="folder with train.bin, val.bin and meta.json")
    parser.add_argument(
        "--output_dir", required=True, help="where the shards go: a folder, or a URL (s3://bucket/prefix)"
    )
    parser.add_argument("--shard_mb", type=float, default=64.0, help="size of each shard in MiB")
    args = parser.parse_args()
    if args.shard_mb <= 0:
        exit_with_error(f"--shard_mb must be greater than 0, got {args.shard_mb}")
    write_or_exit(args.output_dir, lambda: write_shards(args.data_dir, args.output_dir, args.shard_mb))


if __name__ == "__main__":
    main()
