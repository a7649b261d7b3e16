"""The network table: for each link rate and comm hook, the step time of 2 hosts against 1, and
the preflight's prediction beside it. Needs root (two network-namespace hosts, tests/netns.py).

    bash dev/bench.sh --network                 # unlimited, 1gbit, 100mbit, 20mbit x none, bf16, powersgd
    bash dev/bench.sh --network --rates 20mbit --hooks none

Bakes the default (language) project and trains the GPT of its network tests (tests/task.py
NETWORK_ARGS; amp none, gloo, OMP_NUM_THREADS=1) with the generated scripts/launch.sh: 1 host
x 1 process once, then per rate the preflight (`--preflight --json`, which predicts every hook
at once) and 2 hosts x 1 process per hook. Each run trains 24 steps and is timed over its
last 12 (PowerSGD all-reduces plainly for its first 10). Scaling efficiency = throughput of
2 hosts / (2 x throughput of 1 host) = 1-host step time / 2-host step time (the per-process
batch is the same). A benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from cookiecutter.main import cookiecutter
from run import TEMPLATE, cpu_model

RATES = ["unlimited", "1gbit", "100mbit", "20mbit"]
HOOKS = ["none", "bf16", "powersgd"]
STEPS = 24


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=RATES)
    parser.add_argument("--hooks", nargs="+", default=HOOKS, choices=HOOKS)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="network-bench-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work)))
    # The project's own rig and helpers (tests/netns.py, tests/nodes.py), as its tests use them.
    sys.path[:0] = [str(project / "tests"), str(project)]
    os.chdir(project)
    import netns
    import nodes
    import task
    from conftest import run_training

    reason = netns.unavailable_reason()
    if reason:
        sys.exit(f"bench/network.py: two hosts need network namespaces: {reason}")
    flags = [*task.NETWORK_ARGS, "--amp", "none", *nodes.timed_args(STEPS)]
    batch = int(dict(zip(task.NETWORK_ARGS[::2], task.NETWORK_ARGS[1::2]))["--batch_size"])

    def one_host_step(name):
        run_training(work / name, *flags, timeout=900)
        seconds = nodes.step_seconds(work / name, batch)
        print(f"1 host x 1 process: {1000 * seconds:.1f} ms a step", file=sys.stderr, flush=True)
        return seconds

    before = one_host_step("one_host_before")
    rows, reports = [], {}
    for rate in args.rates:
        hosts = netns.TwoHosts()
        hosts.setup()
        try:
            hosts.limit_link(None if rate == "unlimited" else rate)
            report = reports[rate] = nodes.preflight_prediction(hosts, flags, work / f"preflight_{rate}")
            for hook in args.hooks:
                output_dir = work / f"run_{rate}_{hook}"
                measured = nodes.two_host_step_seconds(hosts, [*flags, "--comm_hook", hook], 2 * batch, output_dir)
                predicted = report["by_comm_hook"][hook]
                rows.append((rate, hook, measured, predicted))
                print(f"{rate} {hook}: {1000 * measured:.1f} ms", file=sys.stderr, flush=True)
        finally:
            hosts.teardown()
    one_host = (before + one_host_step("one_host_after")) / 2  # the machine's speed drifts
    print_table(rows, one_host, reports, batch, task.NETWORK_ARGS)


def print_table(rows, one_host, reports, batch, sizes):
    parameters = next(iter(reports.values()))["by_comm_hook"]["none"]["gradient_bytes"] / 4
    print(
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {datetime.date.today()}\n"
        f"- Job: the language task's GPT `{' '.join(sizes)}`, {parameters / 1e6:.2f}M parameters, "
        f"batch {batch} per process, amp none, AdamW, gloo; 2 hosts = two network namespaces joined "
        f"by a veth pair limited with tc tbf, 1 process each.\n"
        f"- 1 host x 1 process: {1000 * one_host:.1f} ms a step (mean of a run before and after).\n"
    )
    print("| link | comm hook | MB a step | 2 hosts: step (ms) | predicted (ms) | error | efficiency | "
          "predicted | 2 hosts vs 1 | predicted |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rate, hook, measured, predicted in rows:
        efficiency = one_host / measured
        print(
            f"| {rate} | {hook} | {predicted['gradient_bytes'] / 2**20:.2f} | {1000 * measured:.1f} | "
            f"{1000 * predicted['job_step_seconds']:.1f} | {predicted['job_step_seconds'] / measured - 1:+.0%} | "
            f"{efficiency:.2f} | {predicted['scaling_efficiency']:.2f} | {2 * efficiency:.2f}x "
            f"({'pays' if efficiency > 0.5 else 'does not pay'}) | {predicted['speedup']:.2f}x "
            f"({'pays' if predicted['speedup'] > 1 else 'does not pay'}) |"
        )
    print("\nThe preflight per link (configured hook none): its compute and synced step, and its advice.\n")
    print("| link | compute (ms) | synced step (ms) | multi_node_pays | try_comm_hook |")
    print("| --- | --- | --- | --- | --- |")
    for rate, report in reports.items():
        print(
            f"| {rate} | {1000 * report['compute_seconds']:.1f} | {1000 * report['job_step_seconds']:.1f} | "
            f"{str(report['multi_node_pays']).lower()} | {report['try_comm_hook'] or '-'} |"
        )


if __name__ == "__main__":
    main()
