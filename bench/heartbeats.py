"""The heartbeats' load on the store and how soon a dead rank is seen (issue 65), at many ranks:
the generated project's store_waits.Heartbeats, as it is now and as git commit --before had
it, each with --ranks simulated ranks against one TCPStore.

    .venv/bin/python bench/heartbeats.py                          # 512 ranks, now vs --before
    .venv/bin/python bench/heartbeats.py --ranks 1024 --processes 8
    .venv/bin/python bench/heartbeats.py --tiny                   # 16 ranks, short phases: the script's path

The store's server runs in a process of its own (its CPU time is read from /proc). The ranks
are threads spread over --processes processes, each rank with its own TCPStore client and
its heartbeat's (Heartbeats(store, rank, ranks), as setup_distributed starts it). Each run
goes through three phases, timed on the wall clock that all its processes share:

1. --idle seconds with no rank waiting (training: only the heartbeats);
2. --window seconds with every rank but 0 waiting in the store, as rank 0's checkpoint write
   keeps them: each looks for its key as store_waits.wait_in_store does (every few ms at
   first, then every quarter second) and asks Heartbeats.gone() every WAIT_SLICE_SECONDS;
3. then one rank dies (its heartbeat stops, and its wait): rank 0 in one run, the last rank
   in another; the others wait on until they name it, or GONE_SECONDS + 30 s.

Every client counts the heartbeats' requests (Heartbeats' own and its gone()'s) and the keys
they name; the waits' own looks for their key are counted apart. Prints, per version: the
requests and keys a second the store served in phases 1 and 2, the server's CPU in each (% of
a core), how far apart a waiting rank's looks at the heartbeats came (WAIT_SLICE_SECONDS
asked: more means the simulation could not keep up, so the load was less than asked), the
seconds from the death to the first, the median and the last waiting rank naming it, and any
rank named that was not dead. A benchmark, not a test: it asserts nothing. On a machine with
few cores the simulated ranks share them with the server: compare the two versions on the
same machine, at the same size.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from run import TEMPLATE, cpu_model, template_at

PROJECT = "{{cookiecutter.project_slug}}"  # the generated project's folder in the template
HOST = "127.0.0.1"


class CountedStore:
    """A TCPStore client that counts its requests and the keys they name (a clone counts its own)."""

    def __init__(self, store, clients):
        self.store, self.requests, self.keys = store, 0, 0
        clients.append(self)
        self.clients = clients

    def _count(self, keys):
        self.requests += 1
        self.keys += keys

    def set(self, key, value):
        self._count(1)
        return self.store.set(key, value)

    def get(self, key):
        self._count(1)
        return self.store.get(key)

    def add(self, key, amount):
        self._count(1)
        return self.store.add(key, amount)

    def check(self, keys):
        self._count(len(keys))
        return self.store.check(keys)

    def multi_get(self, keys):
        self._count(len(keys))
        return self.store.multi_get(keys)

    def multi_set(self, keys, values):
        self._count(len(keys))
        return self.store.multi_set(keys, values)

    def clone(self):
        return CountedStore(self.store.clone(), self.clients)


def serve(port_file):
    """The store's server, in this process, until it is killed; its port written to `port_file`."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    Path(port_file).write_text(str(store.port))
    while True:
        time.sleep(3600)


def sleep_until(moment):
    time.sleep(max(0.0, moment - time.time()))


def simulate(plan):
    """Ranks plan["first"] to plan["last"] (included) of plan["ranks"], as threads: they start
    their heartbeats, say "ready" and read the phases' times from stdin; prints what they counted
    and saw as one JSON line."""
    import torch.distributed as dist

    sys.path.insert(0, plan["project"])
    from ddp_utils.distributed import store_waits

    world, victim, clients = plan["ranks"], plan["victim"], []

    def start(rank):
        client = dist.TCPStore(HOST, plan["port"], is_master=False, timeout=timedelta(seconds=300))
        return rank, store_waits.Heartbeats(CountedStore(client, clients), rank, world)

    # Many at once: a connection may wait seconds on c10d's reverse look-up of its address.
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        beats = dict(pool.map(start, range(plan["first"], plan["last"] + 1)))
    print("ready", flush=True)
    idle_at, wait_at, kill_at, end_at = json.loads(sys.stdin.readline())
    dead, seen, wrong, gaps, polls = threading.Event(), {}, set(), [], dict.fromkeys(beats, 0)

    def wait(rank):  # store_waits.wait_in_store, with the looks timed
        sleep_until(wait_at)
        store, key = beats[rank].store.store, "checkpoint written"  # never set: rank 0 never ends its write
        pause, watched = 0.001, time.monotonic()
        while time.time() < end_at and not (rank == victim and dead.is_set()):
            store.check([key])  # uncounted: the wait's own, the same in both versions (polls)
            polls[rank] += 1
            now = time.monotonic()
            if now - watched >= store_waits.WAIT_SLICE_SECONDS:
                if time.time() < kill_at:
                    gaps.append(now - watched)
                watched, gone = now, beats[rank].gone()
                named = time.time()
                wrong.update(other for other in gone if other != victim or not dead.is_set())
                if victim in gone and dead.is_set():
                    seen[rank] = named - kill_at
                    return
            time.sleep(pause)
            pause = min(2 * pause, store_waits.WAIT_SLICE_SECONDS / 4)

    waiters = [threading.Thread(target=wait, args=(rank,), daemon=True) for rank in beats if rank != 0]
    for thread in waiters:
        thread.start()
    counts = []
    for moment in (idle_at, wait_at, kill_at):
        sleep_until(moment)
        if moment == kill_at and victim in beats:
            beats[victim].stop()
            dead.set()
        elif moment == kill_at:
            dead.set()
        counts.append((sum(c.requests for c in clients), sum(c.keys for c in clients), sum(polls.values())))
    for thread in waiters:
        thread.join(max(0.0, end_at - time.time()))
    result = {"counts": counts, "seen": seen, "wrong": sorted(wrong), "gaps": gaps}
    print(json.dumps(result), flush=True)
    os._exit(0)  # the heartbeat threads beat on: no waiting for them


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trial(project, args, victim, work):
    """One run of `project`'s heartbeats, `victim` dying after the waiting window: the store's
    load in each phase and when the waiting ranks named the victim."""
    port_file = work / f"port-{os.getpid()}-{time.monotonic_ns()}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], stderr=subprocess.DEVNULL)
    try:
        while not port_file.exists() or not port_file.read_text():
            assert server.poll() is None, "the store's server did not start"
            time.sleep(0.05)
        port = int(port_file.read_text())
        plan = {"project": str(project), "port": port, "ranks": args.ranks, "victim": victim}
        share = -(-args.ranks // args.processes)
        sims = []
        for first in range(0, args.ranks, share):
            part = {**plan, "first": first, "last": min(first + share, args.ranks) - 1}
            with open(work / f"simulation{first}.log", "w") as log:  # c10d's warnings
                sims.append(subprocess.Popen([sys.executable, __file__, "--simulate", json.dumps(part)], text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"}))  # fmt: skip
        for first, sim in zip(range(0, args.ranks, share), sims):  # every rank's heartbeat started
            ready = sim.stdout.readline().strip() == "ready"
            assert ready, (
                f"a simulation failed (rc {sim.wait()}): {(work / f'simulation{first}.log').read_text()[-3000:]}"
            )
        idle_at = time.time() + 1 + 2 * args.beat_s  # every heartbeat has beaten
        wait_at, kill_at = idle_at + args.idle, idle_at + args.idle + args.window
        end_at = kill_at + args.gone_s + 30
        for sim in sims:
            sim.stdin.write(json.dumps([idle_at, wait_at, kill_at, end_at]) + "\n")
            sim.stdin.flush()
        cpu = []
        for moment in (idle_at, wait_at, kill_at):
            sleep_until(moment)
            cpu.append(cpu_seconds(server.pid))
        results = []
        for sim in sims:
            out, _ = sim.communicate(timeout=end_at - time.time() + 120)
            assert sim.returncode == 0, f"a simulation failed (rc {sim.returncode}): see {work}/simulation*.log"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    (idle_requests, idle_keys, _), (wait_requests, wait_keys, wait_polls), (end_requests, end_keys, end_polls) = (
        [sum(r["counts"][phase][i] for r in results) for i in (0, 1, 2)] for phase in range(3)
    )
    seen = sorted(s for r in results for s in r["seen"].values())
    waiting = args.ranks - 1 - (victim != 0)  # the ranks that should name the victim
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "idle_requests": (wait_requests - idle_requests) / args.idle,
        "idle_keys": (wait_keys - idle_keys) / args.idle,
        "idle_cpu": 100 * (cpu[1] - cpu[0]) / args.idle,
        "wait_requests": (end_requests - wait_requests) / args.window,
        "wait_keys": (end_keys - wait_keys) / args.window,
        "wait_polls": (end_polls - wait_polls) / args.window,
        "wait_cpu": 100 * (cpu[2] - cpu[1]) / args.window,
        "gap": statistics.median(gaps) if gaps else float("nan"),
        "gap_max": max(gaps, default=float("nan")),
        "first_seen": seen[0] if seen else float("nan"),
        "median_seen": statistics.median(seen) if seen else float("nan"),
        "last_seen": seen[-1] if len(seen) == waiting else float("nan"),
        "missed": waiting - len(seen),
        "wrong": sorted({w for r in results for w in r["wrong"]}),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated ranks are spread over")
    parser.add_argument("--before", default="2ba8c4e", help="the git commit compared with (default: before issue 65)")
    parser.add_argument("--idle", type=float, default=10, help="seconds measured with no rank waiting")
    parser.add_argument("--window", type=float, default=10, help="seconds measured with every rank but 0 waiting")
    parser.add_argument("--tiny", action="store_true", help="16 ranks, 3 s phases: the script's path")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the store's server: its port to this file
    parser.add_argument("--simulate", help=argparse.SUPPRESS)  # some of the ranks: their plan, as JSON
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.simulate:
        return simulate(json.loads(args.simulate))
    if args.tiny:
        args.ranks, args.processes, args.idle, args.window = 16, 2, 3, 3
    work = Path(tempfile.mkdtemp(prefix="heartbeats-bench-"))
    versions = {f"before ({args.before})": template_at(args.before, work) / PROJECT, "now": TEMPLATE / PROJECT}
    sys.path.insert(0, str(TEMPLATE / PROJECT))  # the heartbeats' constants (the same in both versions)
    from ddp_utils.distributed import store_waits

    args.beat_s, args.gone_s, args.slice_s = (
        store_waits.BEAT_SECONDS,
        store_waits.GONE_SECONDS,
        store_waits.WAIT_SLICE_SECONDS,
    )
    results = {}
    for name, project in versions.items():
        for victim in (0, args.ranks - 1):
            results[name, victim] = trial(project, args, victim, work)
            print(f"{name}, rank {victim} killed: {results[name, victim]}", file=sys.stderr, flush=True)

    runs = (0, args.ranks - 1)  # the killed rank of a version's two runs

    def both(key, form="{:.0f}"):  # a version's two runs
        return lambda name: " / ".join(form.format(results[name, victim][key]) for victim in runs)

    def looks(name):
        most = max(results[name, victim]["gap_max"] for victim in runs)
        return " / ".join(f"{results[name, victim]['gap']:.2f}" for victim in runs) + f" / {most:.2f}"

    def seen(victim):
        def cell(name):
            r = results[name, victim]
            missed = f", {r['missed']} never" if r["missed"] else ""
            return f"{r['first_seen']:.1f} / {r['median_seen']:.1f} / {r['last_seen']:.1f}{missed}"

        return cell

    def wrong(name):
        return ", ".join(str(rank) for rank in sorted({w for victim in runs for w in results[name, victim]["wrong"]}))

    rows = [
        ("the heartbeats' store requests/s, no rank waiting", both("idle_requests")),
        ("keys they name/s, no rank waiting", both("idle_keys")),
        ("server CPU, no rank waiting (% of a core)", both("idle_cpu", "{:.1f}")),
        (f"the heartbeats' store requests/s, {args.ranks - 1} ranks waiting", both("wait_requests")),
        (f"keys they name/s, {args.ranks - 1} ranks waiting", both("wait_keys")),
        ("the waits' own looks for their key/s (the same code in both)", both("wait_polls")),
        ("server CPU, ranks waiting (% of a core; all of the above)", both("wait_cpu", "{:.1f}")),
        (f"a waiting rank's looks, s apart (median, median, most; {args.slice_s:g} asked)", looks),
        ("rank 0 killed: named after (s: first / median / last waiting rank)", seen(0)),
        (f"rank {args.ranks - 1} killed: named after (s: first / median / last)", seen(args.ranks - 1)),
        ("ranks named that were alive", lambda name: wrong(name) or "none"),
    ]
    print(f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; Python "
          f"{platform.python_version()}, torch {__import__('torch').__version__}; {datetime.date.today()}")  # fmt: skip
    print(f"- {args.ranks} simulated ranks (threads over {args.processes} processes, each rank its own TCPStore "
          f"client and its heartbeat's) against one TCPStore server (a process of its own); {args.idle:g} s "
          f"measured with no rank waiting, {args.window:g} s with ranks 1-{args.ranks - 1} waiting in the store, "
          f"then a rank killed (two runs a version: rank 0, rank {args.ranks - 1}; a load cell gives both)")  # fmt: skip
    print()
    print("| heartbeats | " + " | ".join(versions) + " |")
    print("| --- |" + " --- |" * len(versions))
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(name) for name in versions) + " |")


if __name__ == "__main__":
    main()
