"""Samples per second of the language task's training loader reading shards from an S3 store
(cold cache: every shard downloaded; warm: every shard already in the node's cache) against the
same windows from a local shards folder and the local token file (the memmap), as train.py
builds the loader (build_loaders), with 0 and 2 DataLoader workers.

    .venv/bin/python bench/streamed_data.py             # 8 MB of tokens, 1 MiB shards, 3 rounds
    .venv/bin/python bench/streamed_data.py --tiny      # the script's path, not its numbers

The store is moto's S3 server on this machine (the generated tests' tests/object_store.py),
reached over HTTP by s3fs: it measures our reading, caching and checking, not a network. Each
round measures every variant once, in turn; reported: the median samples/s over rounds. One
epoch of 128-token windows at batch 64, each batch taken and nothing done with it. A
benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import bake

VARIANTS = ["token file (memmap)", "shards, local folder", "shards, S3 cold cache", "shards, S3 warm cache"]


def measure(args):
    """In a baked project's folder, the store's env set: {variant/workers: samples/s} (JSON)."""
    sys.path.insert(0, os.getcwd())
    import dataclasses
    from types import SimpleNamespace

    import torch

    torch.set_num_threads(1)
    import dataset
    from config import Config
    from ddp_utils.configuration import parse_config
    from ddp_utils.data.loaders import build_loaders, start_epoch

    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    base = parse_config(Config, ["--block_size", "128", "--batch_size", "64", "--data_dir", args.tokens], resolve=False)
    base = dataclasses.replace(base, vocab_size=256)
    cache = Path(args.cache)
    rates = {}
    for variant, data_dir in zip(VARIANTS, [args.tokens, args.local, args.url, args.url]):
        for workers in (0, 2):
            if "cold" in variant:
                shutil.rmtree(cache, ignore_errors=True)
            cfg = dataclasses.replace(base, data_dir=data_dir, num_workers=workers, stream_cache_dir=str(cache))
            if variant.startswith("token"):  # as many windows as the shards hold, at random offsets
                cfg = dataclasses.replace(cfg, train_samples=args.windows)
            train, val = dataset.build_datasets(cfg)
            loader, _ = build_loaders(cfg, ctx, train, val)
            start_epoch(loader, 0, 0, cfg.seed)
            started, samples = time.perf_counter(), 0
            for inputs, _ in loader:
                samples += len(inputs)
            rates[f"{variant}/{workers}"] = samples / (time.perf_counter() - started)
            del loader
    print(json.dumps(rates))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=8.0, help="tokens of training data, in MB (uint8 text)")
    parser.add_argument("--shard_mb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="0.5 MB, one round")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    parser.add_argument("--local", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--windows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args)
    if args.tiny:
        args.megabytes, args.rounds, args.shard_mb = 0.5, 1, 0.125
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    try:
        project, _ = bake("language", work / "bake")
        tokens = work / "text"
        prepare = [
            sys.executable,
            "prepare_data.py",
            "--output_dir",
            str(tokens),
            "--max_bytes",
            str(int(args.megabytes * 1e6)),
        ]
        subprocess.run(prepare, cwd=project, check=True, capture_output=True)
        sys.path.insert(0, str(project / "tests"))
        from object_store import ObjectStore

        with ObjectStore() as store:
            store.client().create_bucket(Bucket="bench")
            env = {**os.environ, **store.env, "OMP_NUM_THREADS": "1"}
            for destination in ("s3://bench/text", str(work / "shards")):
                subprocess.run([sys.executable, "make_shards.py", "--data_dir", str(tokens), "--output_dir", destination,
                                "--shard_mb", str(args.shard_mb)], cwd=project, env=env, check=True, capture_output=True)  # fmt: skip
            index = json.loads((work / "shards" / "index.json").read_text())
            windows = sum((shard["samples"] - 1) // 128 for shard in index["splits"]["train"])
            command = [sys.executable, str(Path(__file__).resolve()), "--measure", "--tokens", str(tokens),
                       "--local", str(work / "shards"), "--url", "s3://bench/text", "--cache", str(work / "cache"),
                       "--windows", str(windows)]  # fmt: skip
            rounds = []
            for _ in range(args.rounds):
                result = subprocess.run(command, cwd=project, env=env, check=True, capture_output=True, text=True)
                rounds.append(json.loads(result.stdout.strip().splitlines()[-1]))
        shards = len(index["splits"]["train"])
        print(
            f"# {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        )
        print(
            f"# {args.megabytes:g} MB of byte tokens: {windows} windows of 128 tokens in {shards} shards of "
            f"{args.shard_mb:g} MiB; batch 64; median of {args.rounds} rounds\n"
        )
        print("| reading | samples/s, no workers | samples/s, 2 workers |")
        print("| --- | ---: | ---: |")
        for variant in VARIANTS:
            cells = [statistics.median(r[f"{variant}/{w}"] for r in rounds) for w in (0, 2)]
            print(f"| {variant} | {cells[0]:,.0f} | {cells[1]:,.0f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
