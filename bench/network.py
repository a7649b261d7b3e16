"""The network table: for each link rate and comm hook, the step time of 2 hosts against 1, and
the preflight's prediction beside it. Needs root (two network-namespace hosts, tests/cluster/netns.py).

    bash dev/bench.sh --network                 # unlimited, 1gbit, 100mbit, 20mbit x none, bf16, powersgd
    bash dev/bench.sh --network --rates 20mbit --hooks none

Bakes the default (language) project and trains the GPT of its network tests (tests/task_settings.py
NETWORK_ARGS; amp none, gloo, OMP_NUM_THREADS=1) with the generated scripts/launch.sh: 1 host
x 1 process once, then per rate the preflight (`--preflight --json`, which predicts every hook
at once) and 2 hosts x 1 process per hook. Each run trains 24 steps and is timed over its
last 12 (PowerSGD all-reduces plainly for its first 10). Scaling efficiency = throughput of
2 hosts / (2 x throughput of 1 host) = 1-host step time / 2-host step time (the per-process
batch is the same). A benchmark, not a test: it asserts nothing.

With --strategies, the cost of each --strategy over the link instead (2 hosts x 2 processes):

    bash dev/bench.sh --network --strategies                    # 1gbit, 100mbit x ddp, fsdp, hsdp
    bash dev/bench.sh --network --strategies hsdp --rates 100mbit

Trains the same GPT (same flags, batch 16 per process; --train_samples sized so that no
epoch ends inside the run) with 1 host x 2 processes (ddp, no link) before and after, and per
rate the preflight once with 2 processes a host (its `internode_bytes_per_step`: what it
predicts each node sends over the link a step, ring estimate) and 2 hosts x 2 processes
under: ddp; fsdp with --replicate_degree 1 (FSDP2 sharded over all 4 processes); hsdp
(--strategy fsdp with the default replicate degree: one replica per host, each sharded over
its 2 processes). Reports the step time, samples/s per process, scaling efficiency =
throughput of the 4 processes / (2 x throughput of 1 host's 2) = per-process throughput
against 1 host's, and beside the preflight's bytes the bytes each host's end of the link
really sent (its tx counter) between the two metrics lines, per step. A run that fails is
reported by the first error its nodes logged (their logs' last lines go to stderr). A
benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from cookiecutter.main import cookiecutter
from run import TEMPLATE, cpu_model

RATES = ["unlimited", "1gbit", "100mbit", "20mbit"]
HOOKS = ["none", "bf16", "powersgd"]
STEPS = 24
# --strategies: what each trains with on 2 hosts x 2 processes, and the rates it runs by default.
STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp", "--replicate_degree", "1"],  # sharded over all 4 processes
    "hsdp": ["--strategy", "fsdp"],  # the default: one replica per host, sharded over its 2
}
STRATEGY_RATES = ["1gbit", "100mbit"]
NPROC = 2  # processes per host under --strategies
# How a run fails: a node exits non-zero or hangs (nodes.run_nodes asserts), or it leaves no
# metrics or no preflight object behind.
RUN_FAILED = (AssertionError, OSError, LookupError, ValueError, ZeroDivisionError)
LOGGED_ERROR = re.compile(r" ERROR |PROBLEM: |^\w[\w.]*(Error|Exception): ")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rates", nargs="+", help=f"default {' '.join(RATES)} ({' '.join(STRATEGY_RATES)} with --strategies)"
    )
    parser.add_argument("--hooks", nargs="+", default=HOOKS, choices=HOOKS)
    parser.add_argument("--strategies", nargs="*", choices=list(STRATEGIES),
                        help=f"measure these strategies (none named: {' '.join(STRATEGIES)}) instead of the hooks")  # fmt: skip
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps a run, the second half timed")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="network-bench-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work)))
    # The project's own rig and helpers (tests/cluster/netns.py and nodes.py), as its tests use them.
    sys.path[:0] = [str(project / "tests" / "cluster"), str(project / "tests"), str(project)]
    os.chdir(project)
    import netns
    import nodes
    import task_settings
    from conftest import run_training

    reason = netns.unavailable_reason()
    if reason:
        sys.exit(f"bench/network.py: two hosts need network namespaces: {reason}")
    flags = [*task_settings.NETWORK_ARGS, "--amp", "none", *nodes.timed_args(args.steps)]
    batch = int(dict(zip(task_settings.NETWORK_ARGS[::2], task_settings.NETWORK_ARGS[1::2]))["--batch_size"])
    if args.strategies is not None:
        strategies = args.strategies or list(STRATEGIES)
        return strategies_bench(work, flags, batch, args.rates or STRATEGY_RATES, strategies, args.steps)

    def one_host_step(name):
        run_training(work / name, *flags, timeout=900)
        seconds = nodes.step_seconds(work / name, batch)
        print(f"1 host x 1 process: {1000 * seconds:.1f} ms a step", file=sys.stderr, flush=True)
        return seconds

    before = one_host_step("one_host_before")
    rows, reports = [], {}
    for rate in args.rates or RATES:
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
    print_table(rows, one_host, reports, batch, task_settings.NETWORK_ARGS)


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


# --- --strategies: ddp, fsdp and hsdp over the link, 2 hosts x 2 processes ------------------


def strategies_bench(work, flags, batch, rates, strategies, steps):
    """1 host x 2 processes before and after; per rate the preflight and each strategy on 2 x 2."""
    import netns
    import nodes
    from conftest import run_training

    # Every run trains within its first epoch (a new epoch restarts the data loader mid-window).
    flags = [*flags, "--train_samples", 2 * NPROC * batch * steps]

    def one_host_step(name):
        run_training(work / name, *flags, *STRATEGIES["ddp"], nproc=NPROC, timeout=900)
        seconds = nodes.step_seconds(work / name, NPROC * batch)
        print(f"1 host x {NPROC} processes: {1000 * seconds:.1f} ms a step", file=sys.stderr, flush=True)
        return seconds

    before = one_host_step("one_host_before")
    rows, reports = [], {}
    for rate in rates:
        hosts = netns.TwoHosts()
        hosts.setup()
        try:
            hosts.limit_link(None if rate == "unlimited" else rate)
            logs_dir = work / f"preflight_{rate}"
            try:
                reports[rate] = two_host_preflight(hosts, flags, logs_dir)
            except RUN_FAILED as error:  # reported with the table: the other runs go on
                reports[rate] = {"failed": failure(error, logs_dir, f"{rate} preflight")}
            for strategy in strategies:
                row = two_host_run(hosts, [*flags, *STRATEGIES[strategy]], 2 * NPROC * batch, work, rate, strategy)
                rows.append((rate, strategy, row))
                if "seconds" in row:
                    print(f"{rate} {strategy}: {1000 * row['seconds']:.1f} ms", file=sys.stderr, flush=True)
        finally:
            hosts.teardown()
    one_host = (before + one_host_step("one_host_after")) / 2  # the machine's speed drifts
    print_strategies_table(rows, one_host, reports, batch, flags, steps)


def two_host_envs(hosts, **extra):
    """launch.sh's settings on each of two hosts, NPROC processes each (nodes.two_host_envs runs 1)."""
    import nodes

    common = {"NNODES": 2, "NPROC_PER_NODE": NPROC, "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": nodes.PORT}
    return [nodes.launch_env(**common, NODE_RANK=rank, **extra) for rank in (0, 1)]


def two_host_preflight(hosts, flags, logs_dir):
    """`launch.sh --preflight --json` on 2 hosts x NPROC: the object rank 0 prints."""
    import nodes
    from conftest import TINY

    command = [nodes.LAUNCH, "--preflight", "--json", *TINY, *map(str, flags)]
    envs = two_host_envs(hosts, PREFLIGHT_MAX_MB=16)
    output = nodes.run_nodes(nodes.start_on(hosts), envs, command, logs_dir, timeout=600)
    (report,) = [json.loads(line) for line in "".join(output).splitlines() if line.startswith("{")]
    return report


def two_host_run(hosts, args, samples_per_step, work, rate, strategy):
    """Train on 2 hosts x NPROC: {"seconds": a step, "link_bytes": what each host's end of the
    link sent a step over the timed steps (mean of the two)}, or {"failed": why}."""
    import nodes
    from conftest import TINY

    output_dir, logs_dir = work / f"run_{rate}_{strategy}", work / f"run_{rate}_{strategy}_logs"
    command = [nodes.LAUNCH, *TINY, *map(str, args), "--output_dir", str(output_dir)]
    counter = LinkCounter(hosts, output_dir / "metrics.jsonl")
    counter.start()
    try:
        nodes.run_nodes(nodes.start_on(hosts), two_host_envs(hosts), command, logs_dir, timeout=600)
        seconds = nodes.step_seconds(output_dir, samples_per_step)
    except RUN_FAILED as error:
        return {"failed": failure(error, logs_dir, f"{rate} {strategy}")}
    finally:
        counter.stop()
    # The last two metrics lines enclose the timed steps (nodes.timed_args: the second half,
    # with the evaluation that ends it and the checkpoint that starts it).
    metrics = nodes.read_metrics(output_dir)
    if len(counter.marks) < 2 or len(metrics) < 2:
        return {"seconds": seconds, "link_bytes": None}
    (before, after), timed_steps = counter.marks[-2:], metrics[-1]["step"] - metrics[-2]["step"]
    return {"seconds": seconds, "link_bytes": (sum(after) - sum(before)) / 2 / timed_steps}


class LinkCounter:
    """The bytes each host's end of the link has sent (its tx counter), read each time the run's
    metrics.jsonl gets a line (polled every 20 ms)."""

    def __init__(self, hosts, metrics):
        self.hosts, self.metrics, self.marks = hosts, metrics, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._done.set()
        self._thread.join()

    def _poll(self):
        lines = 0
        while not self._done.wait(0.02):
            try:
                now = self.metrics.read_bytes().count(b"\n")
            except FileNotFoundError:
                continue
            if now > lines:
                lines = now
                self.marks.append([tx_bytes(namespace) for namespace in self.hosts.namespaces])


def tx_bytes(namespace):
    import netns

    command = ["ip", "-n", namespace, "-s", "-j", "link", "show", netns.IFNAME]
    (link,) = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, timeout=10).stdout)
    return link["stats64"]["tx"]["bytes"]


def failure(error, logs_dir, name):
    """Why a run failed, in one line: the first error its nodes logged (the training's ERROR or
    the preflight's PROBLEM line, else an exception's; torchrun's own summary says nothing), or
    each node's state. The logs' last lines go to stderr."""
    errors = []
    for log in sorted(Path(logs_dir).glob("node*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {name} FAILED, {log}, last lines:", *lines[-15:], sep="\n", file=sys.stderr, flush=True)
        errors += [line.strip() for line in lines if LOGGED_ERROR.search(line) and "ChildFailedError" not in line]
    states = re.findall(r"^--- node (\d+) \((.*?)\):", str(error), re.MULTILINE)  # nodes.describe's
    reason = errors[0] if errors else ", ".join(f"node {node} {state}" for node, state in states)
    return (reason or f"{type(error).__name__}: {error}")[:300].replace("|", "\\|")


def print_strategies_table(rows, one_host, reports, batch, flags, steps):
    per_process = batch / one_host  # samples/s of each process
    print(
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {datetime.date.today()}\n"
        f"- Job: `{' '.join(map(str, flags))}`, batch {batch} per process, amp none, AdamW, gloo, "
        f"OMP_NUM_THREADS=1; {steps} steps a run, timed over the last {steps - steps // 2}; 2 hosts = two "
        f"network namespaces joined by a veth pair limited with tc tbf, {NPROC} processes each.\n"
        f"- 1 host x {NPROC} processes (ddp): {1000 * one_host:.1f} ms a step, {per_process:.1f} samples/s "
        f"per process (mean of a run before and after).\n"
    )
    print("| link | strategy | step (ms) | samples/s per process | scaling efficiency vs 1 host | "
          "preflight: inter-node MB a step, each node | measured: link MB a step, each node |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| none (1 host x {NPROC}) | ddp | {1000 * one_host:.1f} | {per_process:.1f} | 1.00 | - | - |")
    for rate, strategy, row in rows:
        report = reports.get(rate, {})
        predicted = report.get("internode_bytes_per_step", {}).get(strategy)
        predicted = "-" if predicted is None else f"{predicted / 2**20:.2f}"
        if "failed" in row:
            print(f"| {rate} | {strategy} | failed: {row['failed']} | - | - | {predicted} | - |")
            continue
        seconds, link = row["seconds"], row["link_bytes"]
        link = "-" if link is None else f"{link / 2**20:.2f}"
        print(
            f"| {rate} | {strategy} | {1000 * seconds:.1f} | {batch / seconds:.1f} | {one_host / seconds:.2f} | "
            f"{predicted} | {link} |"
        )
    print()
    for rate, report in reports.items():
        if "failed" in report:
            print(f"- {rate}: the preflight failed: {report['failed']}")
        else:
            print(f"- {rate}: the preflight's predicted ddp step {1000 * report['job_step_seconds']:.1f} ms.")


if __name__ == "__main__":
    main()
