"""What a step of --optimizer muon costs against --optimizer adamw: the language task's GPT on
the demo text, the generated train.py with 2 CPU processes (gloo, OMP_NUM_THREADS=1), amp none;
and, with --before REF, Muon as the template at git commit REF made it, in the same rounds.

    .venv/bin/python bench/muon_step.py                  # 5 rounds, GPT 4 x 128, 64-token windows
    .venv/bin/python bench/muon_step.py --before 1397f04 # and Muon before issue 55 (the same job)
    .venv/bin/python bench/muon_step.py --tiny           # the script's path, not its numbers

Each round runs every variant once, in turn (A B C A B C ...), so that drift in the machine's
load hits them alike. A run trains --steps steps with a metrics line every --period steps;
its step time is the training time (compute + data wait, rank 0, from metrics.jsonl) of the
periods after the first (which holds the first steps' warm-up), over their steps. Reported:
each variant's median ms/step and the median of the per-round ratios to AdamW. A benchmark,
not a test: it asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from run import bake, cpu_model, run_job, template_at, torchrun

SIZES = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 16}
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 8}


def train(project, data_flags, args, optimizer, output_dir):
    flags = ["--optimizer", optimizer, "--max_steps", args.steps, "--eval_every_steps", args.period,
             "--train_samples", 100000, "--val_samples", 64, "--amp", "none", "--output_dir", output_dir,
             "--resume", "none", "--progress_bar", "false", "--log_every_steps", 0, *data_flags]  # fmt: skip
    flags += [item for name in SIZES for item in (f"--{name}", getattr(args, name))]
    load_before = os.getloadavg()[0]
    run_job([*torchrun(2), "train.py", *map(str, flags)], project, "INFO training ")
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    later = lines[1:]  # the first period holds the warm-up
    seconds = sum(m["compute_s"] + m["data_wait_s"] for m in later)
    return {"ms_per_step": 1000 * seconds / (later[-1]["step"] - lines[0]["step"]),
            "load": (load_before, os.getloadavg()[0])}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"the GPT's --{name} (default {value})")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--period", type=int, default=20, help="a metrics line every N steps (the first is left out)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant")
    parser.add_argument("--before", help="a git commit of this repository: also Muon as its template made it")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT, 20 steps, 1 round: the script's path")
    args = parser.parse_args()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.steps, args.period, args.rounds = 20, 10, 1

    started = datetime.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="muon-step-bench-"))
    project, data_flags = bake("language", work / "now")
    variants = {"AdamW": (project, "adamw"), "Muon": (project, "muon")}
    if args.before:
        old = template_at(args.before, work)
        old_project = bake("language", work / "before", template=old)[0]
        variants[f"Muon at {args.before}"] = (old_project, "muon")
    runs = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, (where, optimizer) in variants.items():
            result = train(where, data_flags, args, optimizer, work / f"{name.replace(' ', '_')}_{round_}")
            runs[name].append(result)
            print(f"round {round_ + 1} {name}: {result['ms_per_step']:.1f} ms/step, load "
                  "{:.1f}->{:.1f}".format(*result["load"]), file=sys.stderr, flush=True)  # fmt: skip

    loads = [x for rs in runs.values() for r in rs for x in r["load"]]
    tokens = 2 * args.batch_size * args.block_size
    lines = [
        (
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}; {started:%Y-%m-%d %H:%M}; load average "
            f"(1 min) {min(loads):.1f} to {max(loads):.1f} over the runs (2 = the 2 ranks alone)"
        ),
        f"- Command: python bench/muon_step.py {shlex.join(sys.argv[1:])}".rstrip(),
        (
            f"- Job: GPT {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads, byte tokens, "
            f"{args.block_size}-token windows, batch {args.batch_size} per rank x 2 ranks ({tokens} tokens a step), "
            f"{args.steps} steps, amp none, 2 ranks (gloo, OMP_NUM_THREADS=1); ms/step over steps "
            f"{args.period + 1}-{args.steps} (training time of rank 0, evaluation left out); {args.rounds} rounds"
        ),
        "",
        "| variant | ms/step, median (min-max) | x AdamW (median of the rounds' ratios) |",
        "| --- | --- | --- |",
    ]
    for name, results in runs.items():
        ms = [r["ms_per_step"] for r in results]
        ratio = statistics.median(r["ms_per_step"] / a["ms_per_step"] for r, a in zip(results, runs["AdamW"]))
        lines.append(f"| {name} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | {ratio:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
