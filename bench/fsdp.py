"""Benchmark --strategy fsdp against ddp on the same job: the generated train.py (language task)
with 2 CPU processes (gloo), alternating A B A B per round.

    bash dev/bench.sh --fsdp                # 3 rounds, GPT 8x768 (57M parameters), 64-token windows, batch 2
    bash dev/bench.sh --fsdp --rounds 1     # a quick look

Reports, per strategy, medians over rounds of: the bytes of parameters + gradients + AdamW
state that one rank holds (`model_state_mb` in metrics.jsonl: its shards under fsdp), peak
RSS of one rank while training (`peak_memory_mb`) under glibc's default allocator settings
and with MALLOC_MMAP_THRESHOLD_=1048576, and training-loop throughput (tokens/s), with
fsdp's ratio to ddp (median of per-round ratios). The model is sized so that its state, not
the activations, dominates what the strategy changes. A benchmark, not a test: it asserts
nothing.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from cookiecutter.main import cookiecutter
from run import TEMPLATE, cpu_model, run_job, torchrun

SIZES = {"block_size": 64, "n_layer": 8, "n_head": 12, "n_embd": 768, "batch_size": 2}
METRICS = [
    ("model_state_mb", "parameters + gradients + AdamW state per rank (MB)"),
    ("peak_memory_mb", "peak RSS of rank 0 while training (MB)"),
    ("peak_memory_mb_fixed_mmap", "the same, MALLOC_MMAP_THRESHOLD_=1048576 (MB)"),
    ("tokens_per_s", "loop throughput (tokens/s)"),
]
# glibc raises its mmap threshold each time a large block is freed, so later blocks of that
# size come from the heap, which it rarely returns: FSDP's per-block all-gather and gradient
# buffers (tens of MB each, every step) then pile up in RSS. A fixed threshold keeps them mmapped.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def run(project, data, strategy, steps, output_dir, env=None):
    flags = ["--strategy", strategy, "--amp", "none", "--max_steps", steps, "--eval_every_steps", steps,
             "--train_samples", 100000, "--val_samples", 64, "--data_dir", data, "--output_dir", output_dir,
             "--resume", "none", "--progress_bar", "false", "--log_every_steps", 0]  # fmt: skip
    flags += [item for name, value in SIZES.items() for item in (f"--{name}", value)]
    run_job([*torchrun(2), "train.py", *map(str, flags)], project, "INFO training ", env)
    (metrics,) = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {key: metrics[key] for key in ("model_state_mb", "peak_memory_mb", "tokens_per_s")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work)))
    data = work / "text"  # 2 MB of the standard library's source, byte tokens
    prepare = [sys.executable, "prepare_data.py", "--output_dir", str(data), "--max_bytes", "2000000"]
    subprocess.run(prepare, cwd=project, check=True, capture_output=True)
    results = {"ddp": [], "fsdp": []}
    for round_ in range(args.rounds):
        for strategy, runs in results.items():
            runs.append(run(project, data, strategy, args.steps, work / f"{strategy}{round_}"))
            fixed = run(project, data, strategy, args.steps, work / f"{strategy}{round_}_mmap", FIXED_MMAP)
            runs[-1]["peak_memory_mb_fixed_mmap"] = fixed["peak_memory_mb"]
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    parameters = (12 * SIZES["n_embd"] ** 2 + 13 * SIZES["n_embd"]) * SIZES["n_layer"]
    parameters += (256 + SIZES["block_size"] + 2) * SIZES["n_embd"]
    lines = [
        (
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}; {datetime.date.today()}"
        ),
        (
            f"- Job: GPT {SIZES['n_layer']} layers x {SIZES['n_embd']} wide ({parameters / 1e6:.2f}M parameters), "
            f"{SIZES['block_size']}-token windows, batch {SIZES['batch_size']} per rank, {args.steps} steps, "
            f"amp none, AdamW; 2 ranks (gloo, OMP_NUM_THREADS=1); {args.rounds} rounds, alternating A B A B."
        ),
        "",
        "| metric | ddp | fsdp |",
        "| --- | --- | --- |",
    ]
    for key, label in METRICS:
        ddp = statistics.median(r[key] for r in results["ddp"])
        fsdp = statistics.median(r[key] for r in results["fsdp"])
        ratio = statistics.median(f[key] / d[key] for f, d in zip(results["fsdp"], results["ddp"]))
        lines.append(f"| {label} | {ddp:.4g} | {fsdp:.4g} ({ratio:.3f}x) |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
