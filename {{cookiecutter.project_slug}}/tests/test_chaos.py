"""Chaos under sharding: a 2-process --strategy fsdp run with asynchronous sharded checkpoints
after every step takes random faults, each at a random point of its progress, and is started
again by the same command where the job ended; it must end bit for bit like the uninterrupted
run (same final parameters, same metrics lines). The faults:

- sigterm: SIGTERM to torchrun (a preemption): the ranks agree, finish the save in flight and
  the stop's own, and exit; `last` is the step they stopped at.
- kill_job: SIGKILL to torchrun and every worker (a node lost): the save in flight is lost
  half-written.
- kill_worker: SIGKILL to one worker: torchrun (--max-restarts) restarts both from `last`.

Each fault fires a few steps (drawn) past the checkpoint the run resumed from, either while
that step's checkpoint is being written (its temporary folder exists) or once it is saved
(`last` names it): timed off the files the run writes, not by sleeps. The faults are drawn
from a seeded generator (CHAOS_SEED in the environment, else a new seed each run); the seed
and the schedule are printed, so a failure is reproduced with CHAOS_SEED=<seed> (the faults
and their steps; not the microseconds). Every kind fires at least once, and the first
kill_job while a save is being written. Each resume must take the newest checkpoint complete
when the fault fired (or one newer). Same world size, same dtype: nothing but the faults
differs from the uninterrupted run, so the comparison is exact (torch.equal, ==), not at a
tolerance (a resume rounds nothing differently: the fsdp tests compare float64 runs at a
tolerance only across world sizes).

The long version, with more faults: bench/chaos.py in the template's repository.
"""

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    ARGS,
    PROJECT,
    TWO,
    compared_metrics,
    descendants,
    kill_tree,
    read_metrics,
    run_training,
    training_command,
    training_env,
)

from ddp_utils import export
from ddp_utils.distributed import store_waits
from task import TASK

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

KINDS = ("sigterm", "kill_job", "kill_worker")
MOMENTS = ("writing", "saved")


def chaos_args(steps):
    """The run the faults hit: the TINY task (its sizes, its batch of 32 x 2 processes),
    `steps` optimizer steps across epochs, a metrics line every 4 steps (a fault between a
    line and its step's checkpoint: the resume must drop the line and write it again), an
    asynchronous sharded checkpoint every step, the newest 2 kept. A worker whose partner
    was killed while it waited for it at a checkpoint's barrier sees the partner's heartbeat
    stop and leaves within seconds (ddp_utils/distributed/store_waits.py Heartbeats), with the default
    --checkpoint_timeout_seconds."""
    return ["--amp", "none", "--strategy", "fsdp", "--async_checkpoint", "true", "--max_steps", str(steps),
            "--eval_every_steps", "4", "--checkpoint_every_steps", "1", "--keep_checkpoints", "2"]  # fmt: skip


def steps_for(faults):
    """Steps enough for `faults` faults: each fires 2-4 steps past the step the run resumed
    from, and a SIGTERM's stop lands a step or two later still; then 4 steps to spare."""
    return max(32, 6 * faults + 8)


@dataclass
class Fault:
    kind: str  # one of KINDS
    after: int  # fire this many steps past the checkpoint the run resumed from...
    moment: str  # ...while that step's checkpoint is being written, or once it is saved
    rank: int  # kill_worker: the worker killed
    # What happened:
    target: int = 0  # the step it waited for
    seen: str = ""  # what it saw ("writing" or "saved": a quick save may be saved already)
    saved_then: int = 0  # the step `last` named when it fired
    resumed_at: int = None  # the step the resume after it started from (its "resumed from" line)
    fired_s: float = None  # seconds from the first launch
    note: str = ""

    def describe(self):
        victim = f" rank {self.rank}" if self.kind == "kill_worker" else ""
        return f"{self.kind}{victim}, {self.after} steps on, {self.moment}"


def plan(seed, count):
    """`count` faults drawn from `seed`: every kind at least once (with 3 or more), the first
    kill_job while a save is being written (the save in flight lost half-way)."""
    rng = random.Random(seed)
    kinds = list(KINDS) if count >= len(KINDS) else []
    kinds += [rng.choice(KINDS) for _ in range(count - len(kinds))]
    rng.shuffle(kinds)
    faults = [Fault(kind, rng.randint(2, 4), rng.choice(MOMENTS), rng.randrange(2)) for kind in kinds]
    for fault in faults:
        if fault.kind == "kill_job":
            fault.moment = "writing"
            break
    return faults


def schedule_table(seed, faults, steps):
    lines = [f"chaos seed {seed} (CHAOS_SEED={seed} reproduces the schedule): {len(faults)} faults, {steps} steps"]
    lines.append(" #  fault                                  fired at step (seen)  at (s)  last then  resumed at  note")
    for number, fault in enumerate(faults, 1):
        fired = f"{fault.target} ({fault.seen})" if fault.seen else "-"
        at = "-" if fault.fired_s is None else f"{fault.fired_s:.1f}"
        last = fault.saved_then if fault.seen else "-"
        resumed = "-" if fault.resumed_at is None else fault.resumed_at
        lines.append(f"{number:2}  {fault.describe():38} {fired:21} {at:>6}  {last:>9}  {resumed:>10}  {fault.note}")
    return "\n".join(lines)


# --- the job, as the files it writes show it ---------------------------------------------


def saved_step(output_dir):
    """The step of the newest complete sharded checkpoint (the one `last` names), 0 if none."""
    try:
        name = os.readlink(output_dir / "checkpoints" / "last")
    except FileNotFoundError:
        return 0
    return int(re.sub(r"\D", "", os.path.basename(name)))


def being_written(output_dir, step):
    """Whether the checkpoint of `step` is being written (its temporary folder exists, named
    for its writer: .step_<step>.<writer>.tmp)."""
    return any((output_dir / "checkpoints").glob(f".step_{step:09d}.*.tmp"))


def process_state(pid):
    """(state, parent PID) of a process from /proc, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def children(pid):
    """PIDs of the living direct children of `pid` (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        state = process_state(entry.name) if entry.name.isdigit() else None
        if state and state[1] == pid and state[0] != "Z":
            found.append(int(entry.name))
    return found


def rank_of(pid):
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(dict(item.split(b"=", 1) for item in environ if b"=" in item)[b"RANK"])


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def gone(pids, seconds=30):
    """Wait until `pids` (SIGKILLed) have exited, reaping those handed to us (the subreaper)."""
    deadline = time.monotonic() + seconds
    for pid in pids:
        try:
            os.waitpid(pid, 0)
            continue
        except ChildProcessError:  # not ours: wait until it is no longer there
            pass
        while (process_state(pid) or ("Z",))[0] != "Z":
            assert time.monotonic() < deadline, f"process {pid} outlived SIGKILL"
            time.sleep(0.01)


class Job:
    """The same command, launched again after each fault that ends the job; one log per launch."""

    def __init__(self, output_dir, args, restarts, probe):
        self.output_dir, self.args, self.restarts, self.probe = output_dir, args, restarts, probe
        self.process, self.logs = None, []

    def launch(self):
        log = self.output_dir.parent / f"{self.output_dir.name}.launch{len(self.logs)}.log"
        self.logs.append(log)
        command = training_command(self.output_dir, *self.args, nproc=2, probe=self.probe,
                                   torchrun_args=[f"--max-restarts={self.restarts}"])  # fmt: skip
        # A session of its own, so cleanup reaches torchrun's workers too (by PID).
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def log(self):
        return self.logs[-1].read_text()

    def output(self):
        return "".join(f"--- {log.name}\n{log.read_text()}" for log in self.logs)

    def resumes(self):
        """The step each resume started from, in order (restarts and launches)."""
        return [int(step) for step in re.findall(r"resumed from .*: epoch \d+, step (\d+)", self.output())]

    def wait_for(self, fault, seconds=180):
        """Until the run's checkpoint of step `fault.target` is being written (moment "writing")
        or saved; the job must not end first."""
        deadline = time.monotonic() + seconds
        while True:
            if fault.moment == "writing" and being_written(self.output_dir, fault.target):
                return "writing"
            if saved_step(self.output_dir) >= fault.target:
                return "saved"
            code = self.process.poll()
            assert code is None, f"the job ended (rc {code}) before step {fault.target}:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"step {fault.target} not reached in {seconds} s"
            time.sleep(0.005)

    def fire(self, fault):
        """The fault, now; returns whether the job has ended (to be launched again)."""
        torchrun = self.process
        if fault.kind == "sigterm":
            torchrun.send_signal(signal.SIGTERM)
            code = torchrun.wait(timeout=120)
            stopped = re.findall(r"stopped by SIGTERM at step (\d+)", self.log())
            assert code != 0 and stopped, f"no stop after SIGTERM (rc {code}):\n{self.log()[-4000:]}"
            # The save in flight when the stop came is complete, and `last` is the stop's own.
            assert saved_step(self.output_dir) == int(stopped[-1]), (stopped, saved_step(self.output_dir))
            fault.note = f"stopped at step {stopped[-1]}"
            return True
        if fault.kind == "kill_job":
            # torchrun first, so that it restarts no worker; then every process it started.
            everything = descendants(torchrun.pid)
            for pid in [torchrun.pid, *everything]:
                kill(pid)
            torchrun.wait()
            gone(everything)
            fault.note = f"{len(everything) + 1} processes"
            return True
        workers = {rank_of(pid): pid for pid in children(torchrun.pid)}
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[fault.rank], signal.SIGKILL)
        fault.note = f"pid {workers[fault.rank]}"
        return False

    def end(self, timeout=300):
        code = self.process.wait(timeout=timeout)
        assert code == 0, f"the job failed (rc {code}):\n{self.log()[-6000:]}"

    def kill(self):
        if self.process is not None:
            kill_tree(self.process.pid)
            self.process.wait()


def chaos(output_dir, faults, steps, probe="slow", report=print):
    """Run the job through `faults` (filled in as they happen) to its end, and check that each
    was followed by one resume, from the newest checkpoint complete when it fired (or a newer
    one: the save in flight may complete). `probe`: steps slowed by 50 ms a micro-step
    (tests/ddp_probe.py slow), so that a SIGTERM lands well before the run's last step
    however busy the machine. Returns the Job (its logs)."""
    job = Job(output_dir, chaos_args(steps), restarts=len(faults), probe=probe)
    started = time.monotonic()
    job.launch()
    try:
        resumed = 0
        for fault in faults:
            fault.target = min(resumed + fault.after, steps - 4)
            assert fault.target > resumed, f"{steps} steps are too few for the faults"
            fault.seen = job.wait_for(fault)
            fault.saved_then, fault.fired_s = saved_step(output_dir), time.monotonic() - started
            ended = job.fire(fault)
            # Where the next start resumes (a killed worker's partner may still complete the save in flight).
            resumed = saved_step(output_dir)
            report(f"{fault.fired_s:6.1f} s  {fault.describe()}: fired at step {fault.target} ({fault.seen})")
            if ended:
                job.launch()  # the same command again
        job.end()
    finally:
        job.kill()
        for fault, step in zip(faults, job.resumes()):
            fault.resumed_at = step
    resumes = job.resumes()
    assert len(resumes) == len(faults), f"{len(resumes)} resumes after {len(faults)} faults:\n{job.output()[-8000:]}"
    lost = [number for number, fault in enumerate(faults, 1) if fault.resumed_at < fault.saved_then]
    assert not lost, f"faults {lost} resumed from an older checkpoint than the newest complete one"
    return job


def final_weights(output_dir):
    """The whole model of the run's newest checkpoint, gathered from its shards."""
    return export.consolidated(TASK, output_dir / "checkpoints" / "last")["model"]


def differences(output_dir, reference_dir):
    """What differs between the run's end and the uninterrupted run's: parameters not equal,
    metrics lines not equal (all but timings, in order); [] when none."""
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    found = [f"parameter {key} differs" for key in theirs if key not in ours or not torch.equal(ours[key], theirs[key])]
    found += [f"parameter {key} is not in the uninterrupted run" for key in ours.keys() - theirs.keys()]
    ours, theirs = ([compared_metrics(line) for line in read_metrics(d)] for d in (output_dir, reference_dir))
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        line = lambda lines: lines[first] if first < len(lines) else "none"  # noqa: E731
        found.append(f"metrics lines differ from line {first + 1} on ({len(ours)} lines, the uninterrupted run "
                     f"{len(theirs)}): {line(ours)}, the uninterrupted run's {line(theirs)}")  # fmt: skip
    return found


def chaos_seed():
    return int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(10**6))


FAULTS = 4
STEPS = steps_for(FAULTS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same command as the chaos run's, never interrupted."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run_training(output_dir, *chaos_args(STEPS), nproc=2, torchrun_args=[f"--max-restarts={FAULTS}"])
    return output_dir


def test_random_faults_under_async_sharded_checkpoints_end_like_the_uninterrupted_run(uninterrupted, tmp_path):
    seed = chaos_seed()
    faults = plan(seed, FAULTS)
    print(schedule_table(seed, faults, STEPS), flush=True)  # pytest shows it if the test fails
    output_dir = tmp_path / "run"
    try:
        chaos(output_dir, faults, STEPS)
        found = differences(output_dir, uninterrupted)
        assert not found, "the run does not end as the uninterrupted one did:\n" + "\n".join(found[:10])
    except BaseException:
        print(schedule_table(seed, faults, STEPS), flush=True)
        raise


# --- the heartbeats that cut a wait in the store short (ddp_utils/distributed/store_waits.py) ---

# A training run whose rank 0 holds its second checkpoint write until $RELEASE_FILE exists (the
# other rank waits for it at the checkpoint's barrier meanwhile), printing a line as it starts.
HELD_SECOND_SAVE = """
import os, sys, time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch
import task
from ddp_utils.train import run

save, writes, release = torch.save, [], Path(os.environ["RELEASE_FILE"])


def held(obj, f, *args, **kwargs):
    if os.environ["RANK"] == "0" and str(getattr(f, "name", "")).endswith(".pt.tmp"):
        writes.append(1)
        if len(writes) == 2:
            print("PROBE second checkpoint write held", flush=True)
            while not release.exists():
                time.sleep(0.05)
    return save(obj, f, *args, **kwargs)


torch.save = held
sys.exit(run.main(task.TASK, sys.argv[1:]))
"""


def signal_all(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def test_a_job_paused_whole_and_resumed_rank_by_rank_loses_no_rank(tmp_path):
    """The whole job is suspended (SIGSTOP to torchrun and every process under it: a scheduler's
    suspend, a frozen cgroup) for longer than the heartbeats' GONE_SECONDS while rank 1 waits
    in the store for rank 0's checkpoint, then resumed rank 1 first (torchrun and its store
    with it) and rank 0 a second later: rank 1 must not count the time it was stopped itself
    against rank 0, and the run ends as usual."""
    script, release = tmp_path / "held_save.py", tmp_path / "release"
    script.write_text(HELD_SECOND_SAVE)
    output_dir, log = tmp_path / "run", tmp_path / "run.log"
    command = training_command(output_dir, *ARGS, *TWO, nproc=2)
    command[command.index("train.py")] = str(script)
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env({"RELEASE_FILE": str(release)}),
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "second checkpoint write held" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        time.sleep(2)  # rank 1 reaches the barrier and waits there
        everything = [process.pid, *descendants(process.pid)]
        workers = {rank_of(pid): pid for pid in children(process.pid)}
        assert sorted(workers) == [0, 1], workers
        signal_all(everything, signal.SIGSTOP)
        time.sleep(store_waits.GONE_SECONDS + 3)
        signal_all([pid for pid in everything if pid != workers[0]], signal.SIGCONT)
        time.sleep(1)
        os.kill(workers[0], signal.SIGCONT)
        time.sleep(3)  # rank 1 watches a while, then rank 0 writes on
        release.touch()
        code = process.wait(timeout=180)
    finally:
        kill_tree(process.pid)
        process.wait()
    output = log.read_text()
    assert "stopped answering" not in output and code == 0, output[-4000:]


class FlakyStore:
    """A store whose heartbeat clients (its clones) raise on their first `failures` writes, as a
    client whose connection broke, or a busy server past its timeout, does."""

    def __init__(self, store, failures, clone=False):
        self.store, self.left, self.is_clone = store, failures, clone

    def clone(self):
        return FlakyStore(self.store, self.left, clone=True)

    def set(self, key, value):
        if self.is_clone and self.left[0] > 0:
            self.left[0] -= 1
            raise RuntimeError("Connection reset by peer")
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def until(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_store_error_does_not_end_the_heartbeats_and_a_stopped_rank_is_still_seen(monkeypatch):
    """Each rank's heartbeat thread meets errors from the store (three failed writes each): the
    heartbeats go on, and neither rank takes the other for gone; a rank whose heartbeat then
    stops is seen gone by the other, whichever it is."""
    monkeypatch.setattr(store_waits, "BEAT_SECONDS", 0.1)
    monkeypatch.setattr(store_waits, "GONE_SECONDS", 2.0)
    store = dist.HashStore()
    ranks = [store_waits.Heartbeats(FlakyStore(store, failures=[3]), rank, 2) for rank in range(2)]
    try:
        deadline = time.monotonic() + 3 * store_waits.GONE_SECONDS
        while time.monotonic() < deadline:
            assert [beats.gone() for beats in ranks] == [[], []]
            time.sleep(0.1)
        ranks[1].stop()
        until(lambda: ranks[0].gone() == [1], 5 * store_waits.GONE_SECONDS, "rank 1's stopped heartbeat not seen")
        ranks[0].stop()
        until(lambda: ranks[1].gone() == [0], 5 * store_waits.GONE_SECONDS, "rank 0's stopped heartbeat not seen")
    finally:
        for beats in ranks:
            beats.stop()


class CountingStore:
    """A store that counts the keys its requests name."""

    def __init__(self, store):
        self.store, self.keys = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.keys += len(args[0]) if args and isinstance(args[0], list) else 1
            return method(*args)

        return counted


def test_a_waiting_rank_reads_one_key_whatever_the_world_size(monkeypatch):
    """64 ranks on one store: a rank waiting in it reads one key a look (rank 0's verdict), not
    every rank's counter, so the store's load grows as the ranks, not as their square
    (bench/heartbeats.py measures it at 512 ranks); a rank that stops is still named."""
    monkeypatch.setattr(store_waits, "BEAT_SECONDS", 0.1)
    monkeypatch.setattr(store_waits, "GONE_SECONDS", 2.0)
    store, world_size = dist.HashStore(), 64
    ranks = [store_waits.Heartbeats(store, rank, world_size) for rank in range(world_size)]
    waiter = ranks[5]
    waiter.store = counted = CountingStore(store)
    try:
        for _ in range(5):
            before = counted.keys
            assert waiter.gone() == []
            assert counted.keys - before <= 2, f"a look read {counted.keys - before} keys"
            time.sleep(0.1)
        ranks[40].stop()
        until(lambda: waiter.gone() == [40], 5 * store_waits.GONE_SECONDS, "rank 40's stopped heartbeat not seen")
    finally:
        for beats in ranks:
            beats.stop()
