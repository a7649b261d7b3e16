"""Benchmark the generated train.py against the floor (a minimal hand-written DDP loop on the
same model and data: bench/minimal_gpt_ddp.py for the language task, bench/minimal_ddp.py for
the tabular one) and, for tabular where installed, PyTorch Lightning; 2 CPU processes with
gloo, alternating A B A B ... per round.

    bash dev/bench.sh                     # language: 5 rounds, GPT 4x128, 128-token windows
    bash dev/bench.sh --task tabular      # 5 rounds, MLP 256->1024->1024->10, 16384 samples, 2 epochs
    bash dev/bench.sh --tiny              # one quick round, to keep the script working (CI)

Reports medians over rounds and the median of per-round ratios (candidate / floor) of:
training-loop throughput, rank 0's CPU seconds per sample in the loop, whole-process wall
time (start-up, evaluation and checkpoints included), time from launch to the first step,
and peak RSS of one rank. A benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent


def bake(task, work, template=TEMPLATE):
    """The generated project of `task` in `work`, and the flags that point it at its data (for
    the language task, 2 MB of the standard library's source, byte tokens; for vision, the
    digits; tabular: its synthetic data)."""
    from cookiecutter.main import cookiecutter  # here: a GPU machine without it still reads traces

    project = Path(cookiecutter(str(template), no_input=True, output_dir=str(work), extra_context={"task": task}))
    if task == "vision":  # scikit-learn's digits as an image folder
        images = work / "images"
        subprocess.run([sys.executable, "prepare_data.py", "--output_dir", str(images)], cwd=project, check=True,
                       capture_output=True)  # fmt: skip
        return project, ["--data_dir", str(images)]
    if task != "language":
        return project, []
    data = work / "text"
    prepare = [sys.executable, "prepare_data.py", "--output_dir", str(data), "--max_bytes", "2000000"]
    subprocess.run(prepare, cwd=project, check=True, capture_output=True)
    return project, ["--data_dir", str(data)]


def template_at(ref, work):
    """The template as git commit `ref` holds it, unpacked into `work`."""
    archive = work / "template.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), ref], cwd=TEMPLATE, check=True)
    folder = work / f"template-{ref}"
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def run_job(command, cwd, first_step_marker, env=None):
    """Run one torchrun job; time to the first step from the marker line's arrival."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    launched = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, lines = None, []
    for line in process.stdout:
        lines.append(line)
        if first_step is None and first_step_marker in line:
            first_step = time.perf_counter() - launched
    # wait4 gives this job's own usage: ru_maxrss is the largest process of its tree (a rank).
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(lines[-30:])}")
    wall = time.perf_counter() - launched
    return {"wall_s": wall, "first_step_s": first_step, "peak_rss_mb": usage.ru_maxrss / 1024, "lines": lines}


def torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


# The job's sizes, the same for the generated train.py and the floor.
JOBS = {
    "tabular": {"input_dim": 256, "hidden_dim": 1024, "num_classes": 10, "batch_size": 64},
    "language": {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128, "batch_size": 16},
}
TINY_JOBS = {"tabular": {"hidden_dim": 64}, "language": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}}
FLOORS = {"tabular": "minimal_ddp.py", "language": "minimal_gpt_ddp.py"}


def run_generated(project, args, output_dir):
    sizes = JOBS[args.task]
    flags = ["--train_samples", args.samples, "--epochs", args.epochs, "--amp", "none", "--lr", 1e-3,
             "--output_dir", output_dir, "--resume", "none", "--progress_bar", "false", *args.data_flags]  # fmt: skip
    flags += [item for name, value in sizes.items() for item in (f"--{name}", value)]
    # Its defaults stay on: evaluation and a checkpoint every epoch, clipping, the LR schedule,
    # logging every 50 steps.
    result = run_job([*torchrun(2), "train.py", *map(str, flags)], project, "INFO training ")
    metrics = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    global_batch = sizes["batch_size"] * 2
    samples_per_epoch = args.samples // global_batch * global_batch
    loop_s = sum(samples_per_epoch / m["samples_per_s"] for m in metrics)
    cpu_s = sum(m["cpu_s"] for m in metrics)
    return {**result, "samples_per_s": samples_per_epoch * len(metrics) / loop_s,
            "cpu_us_per_sample": 1e6 * cpu_s / (samples_per_epoch * len(metrics) / 2)}  # fmt: skip


def run_floor(project, args, script=None, *script_args):
    flags = ["--train_samples", args.samples, "--epochs", args.epochs, *args.data_flags]
    flags += [item for name, value in JOBS[args.task].items() for item in (f"--{name}", value)]
    command = [*torchrun(2), str(BENCH / (script or FLOORS[args.task])), *script_args, *map(str, flags)]
    result = run_job(command, project, "BENCH first step")
    (report,) = [json.loads(line[6:]) for line in result["lines"] if line.startswith("BENCH {")]
    return {**result, "samples_per_s": report["samples"] / report["loop_s"],
            "cpu_us_per_sample": 1e6 * report["cpu_s"] / (report["samples"] / 2)}  # fmt: skip


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


METRICS = [
    ("units_per_s", "loop throughput ({unit}s/s)", "higher"),
    ("cpu_us_per_unit", "rank-0 CPU per {unit} in the loop (µs)", "lower"),
    ("wall_s", "whole process (s)", "lower"),
    ("first_step_s", "launch to first step (s)", "lower"),
    ("peak_rss_mb", "peak RSS of a rank (MB)", "lower"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=tuple(JOBS), default="language")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=None, help="samples (windows) per epoch")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="one round of a tiny GPT or MLP, to check the script works")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    parser.add_argument("--ceiling", action="store_true",
                        help="language: also the floor with the generated loop's fused AdamW and DDP bucket views, "
                             "the most a loop with no work of its own could reach")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="NAME=N",
                        help="another job size, e.g. --set n_layer=2 (a key of the task's JOBS entry)")  # fmt: skip
    args = parser.parse_args()
    if args.ceiling and args.task != "language":
        parser.error("--ceiling: the language task only (its floor, bench/minimal_gpt_ddp.py, has the two switches)")
    for setting in args.set:
        name, _, value = setting.partition("=")
        if name not in JOBS[args.task] or not value.isdigit():
            parser.error(f"--set {setting}: NAME=N with NAME one of {', '.join(JOBS[args.task])}")
        JOBS[args.task][name] = int(value)
    args.samples = args.samples or {"tabular": 16384, "language": 4096}[args.task]
    args.epochs = args.epochs or {"tabular": 2, "language": 1}[args.task]
    if args.tiny:  # the script's path, not its numbers: one round of the smallest job
        args.rounds, args.samples, args.epochs = 1, 256, 1
        JOBS[args.task].update(TINY_JOBS[args.task])

    work = Path(tempfile.mkdtemp(prefix="ddp-bench-"))
    project, args.data_flags = bake(args.task, work)
    candidates = {"generated train.py": lambda r: run_generated(project, args, work / f"run{r}")}
    if args.ceiling:  # the floor with fused AdamW and bucket views: what a loop of no cost would reach
        candidates["floor + fused AdamW + bucket views"] = lambda r: run_floor(
            project, args, None, "--fused_adamw", "--bucket_views"
        )
    if args.task == "tabular" and importlib.util.find_spec("lightning"):  # not a dependency: compared where installed
        candidates["Lightning Fabric"] = lambda r: run_floor(project, args, "lightning_job.py", "fabric")
        candidates["Lightning Trainer (defaults)"] = lambda r: run_floor(project, args, "lightning_job.py", "trainer")
    results = {"minimal DDP loop (floor)": []} | {name: [] for name in candidates}
    for round_ in range(args.rounds):  # A B A B: drift on a shared machine hits both alike
        results["minimal DDP loop (floor)"].append(run_floor(project, args))
        for name, run in candidates.items():
            results[name].append(run(round_))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    unit, per_sample = ("token", JOBS["language"]["block_size"]) if args.task == "language" else ("sample", 1)
    for run in (run for runs in results.values() for run in runs):
        run["units_per_s"], run["cpu_us_per_unit"] = (
            run["samples_per_s"] * per_sample,
            run["cpu_us_per_sample"] / per_sample,
        )
    floor = results["minimal DDP loop (floor)"]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}"
    software = f"Python {platform.python_version()}, torch {torch.__version__}"
    job = {
        "tabular": f"MLP 256->1024->1024->10, {args.samples} samples, batch 64 per rank",
        "language": "GPT {n_layer} layers x {n_embd} wide, {n_head} heads, byte tokens, {samples} windows of "
        "{block_size} tokens, batch {batch_size} per rank ({tokens} tokens)".format(
            **JOBS["language"],
            samples=args.samples,
            tokens=JOBS["language"]["block_size"] * JOBS["language"]["batch_size"],
        ),
    }[args.task] + ", 2 ranks (gloo, OMP_NUM_THREADS=1)"
    lines = [
        f"- Machine: {machine}; {software}; {datetime.date.today()}",
        f"- Job: {job}, {args.epochs} epochs, AdamW; {args.rounds} rounds, alternating A B A B.",
        "",
        "| metric | " + " | ".join(results) + " |",
        "| --- |" + " --- |" * len(results),
    ]
    for key, label, _ in METRICS:
        cells = []
        for name, runs in results.items():
            median = statistics.median(run[key] for run in runs)
            if runs is floor:
                cells.append(f"{median:.4g}")
            else:
                ratio = statistics.median(run[key] / base[key] for run, base in zip(runs, floor))
                cells.append(f"{median:.4g} ({ratio:.3f}x)")
        lines.append(f"| {label.format(unit=unit)} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
