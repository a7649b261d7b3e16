"""Yours to run: turn an image folder into Parquet shards, in a folder or a bucket, for training
that streams its data (docs/streaming.md).

    python make_shards.py --output_dir s3://my-bucket/digits-v1          # from data/images
    python make_shards.py --data_dir photos --output_dir shards/photos --shard_mb 256
    python train.py --data_dir s3://my-bucket/digits-v1

The folder's flags are train.py's (--data_dir, --val_fraction, --train_samples, --val_samples,
--seed, or a --config file): the shards hold the training and validation images that training on
the folder would read, each file's bytes as they are (PNG, JPEG, ...: decoded when read), its
label and its path, in an order shuffled once from --seed so each shard holds every class. The
images are read file by file, each checked to decode, a shard at a time in memory: a folder of any
size goes through. index.json is written last: a write cut short leaves no dataset, and the same
command starts again into a new place.
"""

import os
import sys

import torch

from config import Config
from dataset import build_datasets
from ddp_utils.configuration import parse_config
from ddp_utils.data import mix_seed
from ddp_utils.data.images import decode_image
from ddp_utils.data.shards import ShardWriter, is_sharded, shown, write_or_exit
from ddp_utils.errors import InputError
from ddp_utils.knobs import OneLineParser, exit_with_error


def parquet_bytes(paths, images, labels):
    """One shard: `path` (under data_dir, for errors), `image` (the file's bytes), `label`."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet  # noqa: PLC0415

    table = pa.table({"path": paths, "image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())})
    sink = pa.BufferOutputStream()
    pyarrow.parquet.write_table(table, sink, compression="none")  # encoded images do not compress further
    return sink.getvalue().to_pybytes()


def write_shards(cfg, output_dir, shard_mb):
    if is_sharded(cfg.data_dir):
        raise InputError(f"--data_dir {shown(cfg.data_dir)} is shards already")
    train, val = build_datasets(cfg)  # the listing only: paths and labels
    writer = ShardWriter(output_dir)
    limit = shard_mb * 2**20
    for split, data in (("train", train), ("val", val)):
        order = torch.randperm(len(data.samples), generator=torch.Generator().manual_seed(mix_seed(cfg.seed, "shards")))
        shard, size = ([], [], []), 0
        for i in order.tolist():
            path, label = data.samples[i]
            with open(path, "rb") as file:
                image = file.read()
            try:  # the loaders check a folder's images before the first step; shards' images here
                decode_image(image, path)
            except OSError as error:
                raise InputError(str(error)) from None
            for column, value in zip(shard, (os.path.relpath(path, cfg.data_dir), image, label)):
                column.append(value)
            size += len(image)
            if size >= limit:
                writer.add(split, parquet_bytes(*shard), len(shard[0]), suffix=".parquet")
                shard, size = ([], [], []), 0
        if shard[0]:
            writer.add(split, parquet_bytes(*shard), len(shard[0]), suffix=".parquet")
    return writer.close({"kind": "images", "classes": list(train.classes)})


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
    cfg = parse_config(Config, rest, resolve=False)
    write_or_exit(args.output_dir, lambda: write_shards(cfg, args.output_dir, args.shard_mb))


if __name__ == "__main__":
    main()
