"""The tabular task's training loader: samples per second as train.py builds it (build_loaders),
batch 1024 of the synthetic example's 32 features, no workers and 2 persistent workers; with
--before REF, the loader of the template at git commit REF beside it, in the same rounds.

    .venv/bin/python bench/tabular_loader.py --before 1397f04  # against the loader before issue 55
    .venv/bin/python bench/tabular_loader.py --input_dim 1024  # the GPU check's MLP width
    .venv/bin/python bench/tabular_loader.py --tiny            # the script's path, not its numbers

Each variant is the tabular project its template bakes, measured in a process of its own (the
projects' modules share names). Settings: --input_noise_std 0 and 0.1 (experiments/
multinode_gpu.toml's), --num_workers 0 and 2. Timed: --epochs epochs after a first one (the
workers started, the first batches' warm-up left out), every batch taken from the loader and
nothing else done with it. Besides the variants, the same loader of this template with
torch's default_collate as its collate_fn: the sample-by-sample collation the dataset's one
gather avoids. Each round runs every variant once, in turn, so that drift in the machine's
load hits them alike; reported: the median samples/s of the rounds, and of the rounds' ratios
to the default_collate row (and to --before's). A benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import TEMPLATE, template_at

BATCH = 1024
SETTINGS = [(noise, workers) for noise in (0.0, 0.1) for workers in (0, 2)]


def bake(template, work):
    from cookiecutter.main import cookiecutter

    work.mkdir(parents=True)
    return Path(cookiecutter(str(template), no_input=True, output_dir=str(work), extra_context={"task": "tabular"}))


def measure(args):
    """In a baked project's folder: {setting: samples/s} of its training loader (JSON on stdout)."""
    sys.path.insert(0, os.getcwd())
    import torch
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    from types import SimpleNamespace

    import dataset
    from config import Config
    from ddp_utils.data.loaders import build_loaders, start_epoch

    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    rates = {}
    for noise, workers in SETTINGS:
        cfg = Config(train_samples=args.samples, val_samples=BATCH, input_dim=args.input_dim, batch_size=BATCH,
                     num_workers=workers, input_noise_std=noise).resolved()  # fmt: skip
        loader, val_loader = build_loaders(cfg, ctx, *dataset.build_datasets(cfg))
        if args.default_collate:
            loader.collate_fn = default_collate
        batches, seconds = 0, 0.0
        for epoch in range(1 + args.epochs):  # the first: warm-up (workers start, first batches)
            start_epoch(loader, epoch, rank=0, seed=cfg.seed)
            started = time.perf_counter()
            count = sum(1 for _ in loader)
            if epoch:
                batches, seconds = batches + count, seconds + time.perf_counter() - started
        rates[f"{noise} {workers}"] = batches * BATCH / seconds
        del loader, val_loader  # their workers end
    print(json.dumps(rates))


def run_variant(project, args, default_collate=False):
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", "--samples", str(args.samples),
               "--epochs", str(args.epochs), "--input_dim", str(args.input_dim)]  # fmt: skip
    if default_collate:
        command.append("--default_collate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        sys.exit(f"bench/tabular_loader.py: the measurement in {project} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a git commit of this repository: also its template's loader")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant")
    parser.add_argument("--samples", type=int, default=65536, help="training samples (an epoch)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed, after the first")
    parser.add_argument("--input_dim", type=int, default=32, help="features per sample (the example's: 32)")
    parser.add_argument("--tiny", action="store_true", help="8 batches an epoch, 1 round: the script's path")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--default_collate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args)
    if args.tiny:
        args.samples, args.epochs, args.rounds = 8 * BATCH, 1, 1

    import torch
    from run import cpu_model

    started = datetime.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="tabular-loader-bench-"))
    project = bake(TEMPLATE, work / "now")
    variants = {"now (one gather, passed on as it is)": (project, False),
                "default_collate (per-sample collation)": (project, True)}  # fmt: skip
    if args.before:
        variants[f"at {args.before}"] = (bake(template_at(args.before, work), work / "before"), False)
    runs = {name: [] for name in variants}
    loads = []
    for round_ in range(args.rounds):
        for name, (where, per_sample) in variants.items():
            loads.append(os.getloadavg()[0])
            runs[name].append(run_variant(where, args, per_sample))
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)

    reference = runs["default_collate (per-sample collation)"]
    lines = [
        (
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}; {started:%Y-%m-%d %H:%M}; load average "
            f"(1 min) {min(loads):.1f} to {max(loads):.1f} over the runs (1 = the benchmark alone)"
        ),
        f"- Command: python bench/tabular_loader.py {shlex.join(sys.argv[1:])}".rstrip(),
        (
            f"- Job: the synthetic data, {args.samples} samples of {args.input_dim} features, batch {BATCH}, "
            f"one training process, OMP_NUM_THREADS=1; samples/s over {args.epochs} epochs after a first; "
            f"{args.rounds} rounds"
        ),
        "",
        "| loader | --input_noise_std | --num_workers | samples/s, median (min-max) | x default_collate |"
        + (f" x at {args.before} |" if args.before else ""),
        "| --- | --- | --- | --- | --- |" + (" --- |" if args.before else ""),
    ]
    for noise, workers in SETTINGS:
        key = f"{noise} {workers}"
        for name, results in runs.items():
            rates = [r[key] for r in results]
            row = f"| {name} | {noise:g} | {workers} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) |"
            for others in [reference] + ([runs[f"at {args.before}"]] if args.before else []):
                row += f" {statistics.median(r[key] / o[key] for r, o in zip(results, others)):.2f} |"
            lines.append(row)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
