"""Where an optimizer step's time goes, in the generated train.py and in the minimal loop, side
by side (issue 28's job: the language task's GPT, 2 layers x 2 heads x 64 wide, 64-token
windows, 16 per rank: 2048 tokens a step, 300 steps, 2 CPU ranks, gloo, amp none).

    bash dev/bench.sh --breakdown             # 3 rounds, alternating floor / generated
    bash dev/bench.sh --breakdown --rounds 1

Each run records optimizer steps 101 to 200 of rank 0 with torch.profiler (the generated loop
through its own --profile_steps, the floor through bench/profiled.py, with the same profiler
settings) and bench/profiled.py adds the same named ranges to both (backward, the loss, and the
generated loop's clipping and step agreement). A step runs from one batch's request to the
next's; its time is split by the events at the top of rank 0's main thread:

  data loading      the DataLoader's __next__ (sampling, reading, collating)
  forward           DistributedDataParallel.forward (the model, and DDP's own work before it)
  loss              F.cross_entropy
  backward          Tensor.backward up to the end of its last autograd node
  all-reduce wait   the rest of Tensor.backward: DDP waiting for the gradient all-reduce
  clipping          the gradients' global norm and scaling (generated loop only)
  optimizer         Optimizer.step; zero_grad: Optimizer.zero_grad
  step agreement    starting the per-step all-reduce of stop and non-finite flags, and reading
                    the previous one (generated loop only)
  other ops         any other torch operation the loop runs itself (loss totals, the flags)
  Python            what no event covers: the loop's own Python between operations, and the
                    profiler's per-event cost there

Profiled steps are slower than plain ones (every operation records an event); the tokens/s
ratio of plain runs is bench/run.py's. A benchmark, not a test: it asserts nothing.
"""

import argparse
import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

from run import BENCH, bake, run_job, torchrun

JOB = {"train_samples": 9600, "epochs": 1, "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch_size": 16}
STEPS = (101, 200)
ROWS = ["data loading", "forward", "loss", "backward", "all-reduce wait", "clipping", "optimizer", "zero_grad",
        "step agreement", "other ops", "Python"]  # fmt: skip


def category(name):
    if name.startswith("enumerate(DataLoader)"):
        return "data loading"
    if name.endswith(".forward"):
        return "forward"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    if name.startswith("Optimizer.zero_grad"):
        return "zero_grad"
    named = {"bench:loss": "loss", "bench:clip": "clipping", "bench:agreement": "step agreement",
             "bench:agreement_read": "step agreement"}  # fmt: skip
    return named.get(name, "other ops")


def breakdown(trace_path):
    """Microseconds per step by category (ROWS), the step, and gloo's threads' busy time, from
    one Chrome trace of rank 0; also the other ops by name."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X"]
    fetches = sorted((e for e in events if e["name"].startswith("enumerate(DataLoader)")), key=lambda e: e["ts"])
    main = (fetches[0]["pid"], fetches[0]["tid"])
    start, end, steps = fetches[0]["ts"], fetches[-1]["ts"], len(fetches) - 1
    on_main = sorted(
        (e for e in events if (e["pid"], e["tid"]) == main and start <= e["ts"] < end),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    # On the CPU the autograd engine runs backward's nodes on the calling thread; with CUDA
    # tensors on a thread of its own per device: take them from any thread.
    nodes = [e for e in events if e["name"].startswith("autograd::engine::evaluate_function")]
    totals, others, covered_to = collections.Counter(), collections.Counter(), -1
    for event in on_main:
        if event["name"].startswith("optimizer_step#") or event["ts"] < covered_to:
            continue  # the generated loop's step ranges, or an event inside one already counted
        covered_to = event["ts"] + event["dur"]
        if event["name"] == "bench:backward":
            ends = [n["ts"] + n["dur"] for n in nodes if event["ts"] <= n["ts"] < covered_to]
            last = min(max(ends, default=covered_to), covered_to)
            totals["backward"] += last - event["ts"]
            totals["all-reduce wait"] += covered_to - last
            continue
        name = category(event["name"])
        totals[name] += event["dur"]
        if name == "other ops":
            others[event["name"]] += event["dur"]
    totals["Python"] = (end - start) - sum(totals.values())
    gloo = sum(e["dur"] for e in events if e["name"].startswith("gloo:") and start <= e["ts"] < end)
    per_step = {row: totals[row] / steps for row in ROWS}
    per_step["step"], per_step["gloo threads"] = (end - start) / steps, gloo / steps
    per_step["GPU idle"] = gpu_idle_share(events, start, end)
    return per_step, {name: us / steps for name, us in others.items()}


def gpu_idle_share(events, start, end):
    """The share of [start, end) in which no kernel, copy or memset runs on any GPU stream (the
    trace's GPU times are on the host's clock), or None for a trace without GPU events."""
    spans = sorted(
        (max(e["ts"], start), min(e["ts"] + e["dur"], end))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < end and e["ts"] + e["dur"] > start
    )
    if not spans:
        return None
    busy, reached = 0.0, start
    for lo, hi in spans:
        if hi > reached:
            busy += hi - max(lo, reached)
            reached = hi
    return 1 - busy / (end - start)


def job_flags():
    return [str(item) for name, value in JOB.items() for item in (f"--{name}", value)]


def run_floor(project, data_flags, out):
    command = [*torchrun(2), str(BENCH / "profiled.py"), str(BENCH / "minimal_gpt_ddp.py"), *job_flags(),
               *data_flags, "--profile_steps", f"{STEPS[0]}:{STEPS[1]}"]  # fmt: skip
    run_job(command, project, "BENCH first step", env={"BENCH_PROFILE_DIR": str(out)})
    return out / f"trace_steps_{STEPS[0]}-{STEPS[1]}.json"


def run_generated(project, data_flags, out):
    command = [*torchrun(2), str(BENCH / "profiled.py"), "train.py", *job_flags(), *data_flags,
               "--amp", "none", "--lr", "1e-3", "--output_dir", str(out), "--resume", "none",
               "--progress_bar", "false", "--profile_steps", f"{STEPS[0]}:{STEPS[1]}"]  # fmt: skip
    run_job(command, project, "INFO training ")
    return out / "profile" / f"trace_steps_{STEPS[0]}-{STEPS[1]}.json"


def table(columns):
    """Markdown rows: each part of a step, one column per loop (its medians), and the difference
    of the last to the first."""
    names = list(columns)
    lines = ["| part of a step | " + " | ".join(names) + (" | difference |" if len(names) > 1 else " |"),
             "| --- |" + " --- |" * (len(names) + (len(names) > 1))]  # fmt: skip
    for row in [*ROWS, "step"]:
        values = [statistics.median(r[row] for r in columns[name]) for name in names]
        cells = [f"{v:.0f}" for v in values] + ([f"{values[-1] - values[0]:+.0f}"] if len(names) > 1 else [])
        lines.append(f"| {'**whole step**' if row == 'step' else row} | " + " | ".join(cells) + " |")
    for extra, label in (("gloo threads", "(gloo's threads, busy beside the step)"), ("GPU idle", "GPU idle share")):
        values = [[r[extra] for r in columns[name] if r[extra] is not None] for name in names]
        if all(values):
            medians = [statistics.median(v) for v in values]
            cells = [f"{100 * m:.1f}%" if extra == "GPU idle" else f"{m:.0f}" for m in medians]
            lines.append(f"| {label} | " + " | ".join(cells) + (" | |" if len(names) > 1 else " |"))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--trace", type=Path, action="append",
                        help="only break down this Chrome trace of a run through bench/profiled.py (e.g. on a GPU, "
                             "bench/gpu_check.sh); repeat for columns side by side")  # fmt: skip
    args = parser.parse_args()
    if args.trace:
        # Named after the run's folder (train.py writes its trace to OUTPUT_DIR/profile/).
        columns = {(path.parent.parent if path.parent.name == "profile" else path.parent).name: [breakdown(path)[0]]
                   for path in args.trace}  # fmt: skip
        print("\n".join(table(columns)))
        return
    work = Path(tempfile.mkdtemp(prefix="ddp-breakdown-"))
    project, data_flags = bake("language", work)
    loops = {"minimal loop": run_floor, "generated train.py": run_generated}
    results = {name: [] for name in loops}
    others = {name: collections.Counter() for name in loops}
    for round_ in range(args.rounds):
        for name, run in loops.items():
            per_step, ops = breakdown(run(project, data_flags, work / f"{name.split()[0]}{round_}"))
            results[name].append(per_step)
            others[name].update({op: us / args.rounds for op, us in ops.items()})
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    job = (
        f"- Job: GPT {JOB['n_layer']} layers x {JOB['n_embd']} wide, {JOB['n_head']} heads, {JOB['block_size']}-token "
        f"windows, batch {JOB['batch_size']} per rank, 2 ranks (gloo, OMP_NUM_THREADS=1), steps {STEPS[0]}-{STEPS[1]} "
        f"of rank 0 profiled; medians of {args.rounds} rounds (µs per optimizer step)"
    )
    lines = [
        job,
        "",
        *table(results),
    ]
    for name in loops:
        top = ", ".join(f"{op} {us:.0f}" for op, us in others[name].most_common(8) if us >= 1)
        lines.append(f"\nOther ops, {name} (µs per step): {top or 'none'}")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
