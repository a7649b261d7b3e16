"""Chaos under sharding, the long version of the generated project's tests/test_chaos.py: many
random faults to one 2-process --strategy fsdp run with asynchronous sharded checkpoints after
every step, each followed by the same command where the job ended; the run must end bit for
bit like the uninterrupted one.

    .venv/bin/python bench/chaos.py                        # 12 faults, a new seed
    .venv/bin/python bench/chaos.py --faults 12 --seed 5   # that schedule again
    .venv/bin/python bench/chaos.py --task tabular         # another task's project

Bakes the project (the language task by default) and drives it with its own test's machinery
(tests/test_chaos.py: the faults, drawn from the seed, every kind at least once: SIGTERM to
torchrun, SIGKILL to the whole job, SIGKILL to one worker that torchrun restarts; each timed
off the checkpoints the run writes; each resume from the newest complete checkpoint), over
a run long enough for them (tests/test_chaos.py steps_for), and runs the same command once
uninterrupted. Prints each fault (when it fired, in steps and seconds from the first
launch, the step `last` named then, the step the resume started from) and the final
comparison: parameters equal (torch.equal) and metrics lines equal (all but timings, in
order). Progress goes to stderr. Exits 1 when the run fails or differs; the seed reproduces
the schedule (not the microseconds).
"""

import argparse
import datetime
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from cookiecutter.main import cookiecutter
from run import TEMPLATE, cpu_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--seed", type=int, help="the schedule's seed (default: a new one)")
    parser.add_argument("--task", default="language", choices=["language", "vision", "tabular"])
    args = parser.parse_args()
    seed = random.SystemRandom().randrange(10**6) if args.seed is None else args.seed
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work), extra_context={"task": args.task}))
    # The project's own test and helpers, as its suite runs them.
    sys.path[:0] = [str(project / "tests"), str(project)]
    os.chdir(project)
    import test_chaos
    from conftest import run_training

    faults = test_chaos.plan(seed, args.faults)
    steps = test_chaos.steps_for(args.faults)
    restarts = [f"--max-restarts={args.faults}"]
    started = time.monotonic()
    run_training(work / "uninterrupted", *test_chaos.chaos_args(steps), nproc=2, torchrun_args=restarts, timeout=600)
    uninterrupted_s = time.monotonic() - started
    print(f"uninterrupted run: {uninterrupted_s:.1f} s", file=sys.stderr, flush=True)
    started, failure = time.monotonic(), None
    try:
        test_chaos.chaos(work / "run", faults, steps, report=lambda line: print(line, file=sys.stderr, flush=True))
    except AssertionError as error:
        failure = str(error)
    chaos_s = time.monotonic() - started
    if failure is None:
        found = test_chaos.differences(work / "run", work / "uninterrupted")
        lines = len(test_chaos.read_metrics(work / "run"))
        tensors = len(test_chaos.final_weights(work / "run"))
        verdict = (
            f"bit for bit the uninterrupted run: {tensors} parameter tensors equal, {lines} metrics lines equal"
            if not found
            else "DIFFERS from the uninterrupted run: " + "; ".join(found)
        )
    else:
        found, verdict = [failure], f"FAILED: {failure}"
    print(
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {datetime.date.today()}"
    )
    print(
        f"- Job: {args.task} task (tests' TINY), 2 processes (gloo, OMP_NUM_THREADS=1), --strategy fsdp "
        f"--async_checkpoint true, a checkpoint every step (2 kept), {steps} steps, a metrics line every 4; "
        f"seed {seed}, {args.faults} faults; uninterrupted {uninterrupted_s:.0f} s, with the faults {chaos_s:.0f} s."
    )
    print()
    print("| # | fault | when | fired at step (seen) | at (s) | `last` then | resumed at | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for number, fault in enumerate(faults, 1):
        victim = f" rank {fault.rank}" if fault.kind == "kill_worker" else ""
        fired = f"{fault.target} ({fault.seen})" if fault.seen else "-"
        at = "-" if fault.fired_s is None else f"{fault.fired_s:.1f}"
        last = fault.saved_then if fault.seen else "-"
        resumed = "-" if fault.resumed_at is None else fault.resumed_at
        when = f"{fault.after} steps on, {fault.moment}"
        print(f"| {number} | {fault.kind}{victim} | {when} | {fired} | {at} | {last} | {resumed} | {fault.note} |")
    print()
    print(f"Final: {verdict}")
    print(f"(outputs in {work})", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
