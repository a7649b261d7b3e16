"""Time to quality: --optimizer adamw against --optimizer muon on a task's example model (the
language task's GPT on the demo text, the standard library's source in byte tokens; with
--task vision or tabular, that task's model and demo data as experiments/quick_cpu.toml sets
them), the generated train.py with 2 CPU processes (gloo, OMP_NUM_THREADS=1), everything else
at the template's defaults (cosine schedule to 0.1 x lr, no warmup, clipping at 1.0, weight
decay 0.01, amp none).

    .venv/bin/python bench/time_to_quality.py             # GPT 4 x 128, 64-token windows, 300 steps: ~20 min
    .venv/bin/python bench/time_to_quality.py --n_layer 2 --steps 200 --muon_lrs 3e-3,1e-2
    .venv/bin/python bench/time_to_quality.py --defaults  # no sweep: both at config.py's --lr and --muon_lr
    .venv/bin/python bench/time_to_quality.py --task vision --defaults
    .venv/bin/python bench/time_to_quality.py --tiny      # the script's path, not its numbers (~1 min)

1. A learning-rate sweep, seed 0: AdamW at each --lr of --adamw_lrs, Muon at each --muon_lr of
   --muon_lrs (the peak of Muon's matrices; the rest, AdamW's, at the default --lr), alternating
   adamw / muon so that drift in the machine's load hits both alike. With --defaults, no sweep:
   each optimizer at the defaults, what `--optimizer muon` with no other change does.
2. Each optimizer's best lr (lowest final validation loss of seed 0) again with seeds 1 ..
   --seeds - 1.
3. Tables: every run (final val loss, training seconds, time per step, the 1-minute load
   average before and after it), the validation-loss curve of each best lr (mean over seeds)
   against optimizer steps and training seconds, and the steps and seconds each needs to reach
   a target loss (--target, default AdamW's mean final validation loss).

Seconds are training time as metrics.jsonl reports it (compute + data wait, rank 0), the
evaluations and checkpoints left out; on a shared machine they move with its load, printed
beside them. Steps to the target are those of the first evaluation at or below it (a
resolution of --eval_every steps). A benchmark, not a test: it asserts nothing, and it reports
what it measures, a Muon that does not pay included.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from run import bake, cpu_model, run_job, torchrun

SIZES = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 16}
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 8}
OPTIMIZERS = ("adamw", "muon")
NAMES = {"adamw": "AdamW", "muon": "Muon"}
LR_FLAGS = {"adamw": "--lr", "muon": "--muon_lr"}  # what each sweep sets


def load():
    """The 1-minute load average (2 ranks on 2 CPUs alone: about 2)."""
    return os.getloadavg()[0]


def job_flags(args):
    """The job: the GPT at SIZES (language), or the task's quick_cpu.toml."""
    if args.task != "language":
        return ["--config", "experiments/quick_cpu.toml"]
    flags = ["--train_samples", 100000, "--val_samples", args.val_samples]
    return flags + [item for name in SIZES for item in (f"--{name}", getattr(args, name))]


def train(project, data_flags, args, optimizer, lr, seed, output_dir):
    flags = [*job_flags(args), "--optimizer", optimizer, "--seed", seed, "--max_steps", args.steps,
             "--eval_every_steps", args.eval_every, "--amp", "none", "--output_dir", output_dir, "--resume", "none",
             "--progress_bar", "false", "--log_every_steps", 0, *data_flags]  # fmt: skip
    if lr is not None:  # else the default of its knob
        flags += [LR_FLAGS[optimizer], lr]
    load_before = load()
    result = run_job([*torchrun(2), "train.py", *map(str, flags)], project, "INFO training ")
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    seconds, curve = 0.0, []
    for metrics in lines:  # one line per evaluation; its timing is the training since the last one
        seconds += metrics["compute_s"] + metrics["data_wait_s"]
        curve.append((metrics["step"], metrics["val_loss"], seconds))
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "curve": curve, "final": curve[-1][1],
            "train_s": seconds, "ms_per_step": 1000 * seconds / curve[-1][0], "wall_s": result["wall_s"],
            "load": (load_before, load())}  # fmt: skip


def mean_curve(runs):
    """[(step, mean val loss, its standard deviation over seeds, mean training seconds)]."""
    curves = [run["curve"] for run in runs]
    points = []
    for per_seed in zip(*curves):
        losses = [loss for _, loss, _ in per_seed]
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        points.append((per_seed[0][0], statistics.fmean(losses), spread, statistics.fmean(s for *_, s in per_seed)))
    return points


def first_below(points, target):
    """The first (step, seconds) of a mean curve at or below `target`, or None."""
    return next(((step, seconds) for step, loss, _, seconds in points if loss <= target), None)


def lr_text(lr):
    return "default" if lr is None else f"{lr:g}"


def describe_job(args):
    if args.task != "language":
        return f"the {args.task} task's example model and demo data, experiments/quick_cpu.toml's sizes"
    n, L = args.n_embd, args.n_layer
    hidden = 12 * n * n * L  # per block: qkv 3n², proj n², fc 4n², proj 4n²: Muon's
    parameters = hidden + 13 * n * L + 2 * n + (256 + args.block_size) * n  # the head shares tok_emb
    return (f"GPT {L} layers x {n} wide, {args.n_head} heads ({parameters / 1e6:.2f}M parameters, Muon's hidden "
            f"matrices {hidden / 1e6:.2f}M), byte tokens, {args.block_size}-token windows, batch {args.batch_size} "
            f"per rank x 2 ranks ({2 * args.batch_size * args.block_size} tokens a step), validation on "
            f"{args.val_samples} windows")  # fmt: skip


def fmt_load(run):
    return "{:.1f}->{:.1f}".format(*run["load"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"the GPT's --{name} (default {value})")
    parser.add_argument(
        "--task",
        choices=("language", "vision", "tabular"),
        default="language",
        help="whose example model (vision, tabular: experiments/quick_cpu.toml; SIZES are the GPT's)",
    )
    parser.add_argument("--defaults", action="store_true", help="no sweep: each optimizer at config.py's defaults")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--eval_every", type=int, default=25, help="evaluate every N steps: the curve's points")
    parser.add_argument("--val_samples", type=int, default=256, help="validation windows (the same for every run)")
    parser.add_argument("--adamw_lrs", default="3e-4,1e-3,3e-3,1e-2", help="AdamW's --lr values in the sweep")
    parser.add_argument("--muon_lrs", default="1e-3,3e-3,1e-2,3e-2", help="Muon's --muon_lr values in the sweep")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at each optimizer's best lr (seed 0: the sweep's)")
    parser.add_argument("--target", type=float, default=None, help="target val loss (default: AdamW's mean final)")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT, 20 steps, 2 lrs, 2 seeds: the script's path")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.steps, args.eval_every, args.val_samples, args.seeds = 20, 10, 32, 2
        args.adamw_lrs = args.muon_lrs = "1e-3,1e-2"
    grids = {o: [float(lr) for lr in getattr(args, f"{o}_lrs").split(",")] for o in OPTIMIZERS}
    if args.defaults:
        grids = {o: [None] for o in OPTIMIZERS}
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval_every (every run's curve ends at its last step)")

    started = datetime.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="ttq-bench-"))
    project, data_flags = bake(args.task, work)
    runs = []

    def one(optimizer, lr, seed):
        runs.append(train(project, data_flags, args, optimizer, lr, seed, work / f"{optimizer}_{lr_text(lr)}_{seed}"))
        r = runs[-1]
        print(f"{optimizer} lr {lr_text(lr)} seed {seed}: val {r['final']:.4f}, {r['train_s']:.1f} s training, "
              f"{r['wall_s']:.0f} s wall, load {fmt_load(r)}", file=sys.stderr, flush=True)  # fmt: skip

    for index in range(max(map(len, grids.values()))):  # A B A B
        for optimizer in OPTIMIZERS:
            if index < len(grids[optimizer]):
                one(optimizer, grids[optimizer][index], 0)
    best = {}
    for optimizer in OPTIMIZERS:
        sweep = [r for r in runs if r["optimizer"] == optimizer]
        best[optimizer] = min(sweep, key=lambda r: r["final"] if math.isfinite(r["final"]) else math.inf)["lr"]
    for seed in range(1, args.seeds):
        for optimizer in OPTIMIZERS:
            one(optimizer, best[optimizer], seed)

    at_best = {o: [r for r in runs if r["optimizer"] == o and r["lr"] == best[o]] for o in OPTIMIZERS}
    curves = {o: mean_curve(at_best[o]) for o in OPTIMIZERS}
    target = args.target if args.target is not None else curves["adamw"][-1][1]
    reached = {o: first_below(curves[o], target) for o in OPTIMIZERS}
    elapsed = (datetime.datetime.now() - started).total_seconds()

    lines = [
        (
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}; {started:%Y-%m-%d %H:%M}; load average "
            f"(1 min) {min(r['load'][0] for r in runs):.1f} to {max(max(r['load']) for r in runs):.1f} over the "
            f"runs (2 = the 2 ranks alone); {elapsed / 60:.0f} min in all"
        ),
        f"- Command: python bench/time_to_quality.py {shlex.join(sys.argv[1:])}".rstrip(),
        (
            f"- Job: {describe_job(args)}, {args.steps} steps, validation every {args.eval_every} steps; cosine to "
            f"0.1 x lr, no warmup, clip 1.0, weight decay 0.01, amp none; 2 ranks (gloo, OMP_NUM_THREADS=1). Seconds: "
            f"training time (rank 0, evaluation left out). Learning rates: AdamW's --lr, Muon's --muon_lr (its other "
            f"parameters at the default --lr); 'default': config.py's."
        ),
        "",
        (
            f"Learning-rate sweep (seed 0 at each lr; seeds 1..{args.seeds - 1} at each optimizer's best, marked *):"
            if not args.defaults
            else f"Each optimizer at its defaults, seeds 0..{args.seeds - 1}:"
        ),
        "",
        "| optimizer | lr | seed | final val loss | training s | ms/step | load (1 min) before->after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(runs, key=lambda r: (OPTIMIZERS.index(r["optimizer"]), r["lr"] or 0, r["seed"])):
        star = "*" if r["lr"] == best[r["optimizer"]] and not args.defaults else ""
        lines.append(f"| {NAMES[r['optimizer']]} | {lr_text(r['lr'])}{star} | {r['seed']} | {r['final']:.4f} | "
                     f"{r['train_s']:.1f} | {r['ms_per_step']:.0f} | {fmt_load(r)} |")  # fmt: skip
    for optimizer in OPTIMIZERS:
        if best[optimizer] in (min(grids[optimizer]), max(grids[optimizer])) and len(grids[optimizer]) > 1:
            lines.append(f"\nNote: {NAMES[optimizer]}'s best lr {lr_text(best[optimizer])} is at the edge of the grid.")

    lines += ["", f"Validation loss at each evaluation, best lr, mean ± sd over {args.seeds} seeds (training s: mean):",
              "", "| step | " + " | ".join(f"{NAMES[o]} lr {lr_text(best[o])}: val loss | training s" for o in OPTIMIZERS)
              + " |", "| --- |" + " --- | --- |" * len(OPTIMIZERS)]  # fmt: skip
    for points in zip(*(curves[o] for o in OPTIMIZERS)):
        cells = [f"{loss:.4f} ± {spread:.4f} | {seconds:.1f}" for _, loss, spread, seconds in points]
        lines.append(f"| {points[0][0]} | " + " | ".join(cells) + " |")

    source = "--target" if args.target is not None else "AdamW's mean final val loss"
    lines += ["", f"Time to the target val loss {target:.4f} ({source}), mean curve over seeds:", "",
              ("| optimizer | lr | steps | training s | ms/step (median over all its runs, min-max) | "
               "final val loss (mean) | load (1 min) over its runs |"), "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for optimizer in OPTIMIZERS:
        every = [r for r in runs if r["optimizer"] == optimizer]
        ms = [r["ms_per_step"] for r in every]
        loads = [x for r in every for x in r["load"]]
        hit = reached[optimizer]
        steps, seconds = (str(hit[0]), f"{hit[1]:.1f}") if hit else ("not reached", "not reached")
        lines.append(f"| {NAMES[optimizer]} | {lr_text(best[optimizer])} | {steps} | {seconds} | "
                     f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f}) | {curves[optimizer][-1][1]:.4f} | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")  # fmt: skip
    ms = {o: statistics.median(r["ms_per_step"] for r in runs if r["optimizer"] == o) for o in OPTIMIZERS}
    summary = f"Muon's step costs {ms['muon'] / ms['adamw']:.2f}x AdamW's (medians)"
    if reached["muon"] and reached["adamw"]:
        summary += (f"; to the target Muon needs {reached['muon'][0] / reached['adamw'][0]:.2f}x AdamW's steps and "
                    f"{reached['muon'][1] / reached['adamw'][1]:.2f}x its training seconds")  # fmt: skip
    for optimizer in (o for o in OPTIMIZERS if not reached[o]):
        summary += f"; {NAMES[optimizer]} does not reach the target in {args.steps} steps"
    lines += ["", summary + "."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
