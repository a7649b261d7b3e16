"""One run owns its output folder (ddp_utils/train/folder_claim.py): a second run into a live folder
is refused and the first ends as if alone; a dead owner's claim is taken over; an earlier start
of the same job is waited for; each launcher names its job."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import tomllib
from conftest import (
    ARGS,
    LR,
    PROJECT,
    TWO,
    assert_same_metrics,
    assert_same_parameters,
    checkpoint,
    descendants,
    kill_tree,
    run_training,
    training_command,
    training_env,
    wait_for,
)

from ddp_utils.checkpoint.loading import load_checkpoint
from ddp_utils.errors import ClaimRefused
from ddp_utils.train import folder_claim
from ddp_utils.train.folder_claim import CLAIM_FILE, Claim, job_identity

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none


@pytest.fixture
def start_slow_run():
    """Start a 2-process float64 run (as the `reference` runs) that crawls, 200 ms a micro-step,
    until the file `release` exists; killed at the end of the test. Its output goes to
    `log` (default: the output folder's name + .log beside it); `probe` adds probes; with
    `another_machine`, as on another machine that shares this file system; `hold_at`: it stops
    at that micro-step until released (it cannot end before, however slow the machine); `args`
    after the reference's, `env` added to the environment."""
    processes = []

    def start(output_dir, release, log=None, probe="", another_machine=False, hold_at=0, args=(), env=None):
        log = open(log or output_dir.parent / f"{output_dir.name}.log", "w")
        probes = ",".join(filter(None, ["float64,slow_until_released", probe]))
        command = training_command(output_dir, *ARGS, *TWO, *args, nproc=2, probe=probes)
        if another_machine:
            command = on_another_machine(command)
        env = training_env({"RELEASE_FILE": str(release), "HOLD_AT_CALL": str(hold_at), **(env or {})})
        process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        processes.append(process)
        return process

    yield start
    for process in processes:
        kill_tree(process.pid)
        process.wait()


def on_another_machine(command):
    """`command` as on another machine that shares this file system: in a process namespace of
    its own (folder_claim.machine_identity differs; the hostname stays, for the rendezvous to
    resolve), so another start can take its claim over only when the claim is stale on the
    file system's clock, as across real hosts."""
    return ["unshare", "--pid", "--fork", "--kill-child", *command]


def claim_ages(path, too_old):
    """Sample how long ago the claim at `path` was renewed on the file system's own clock (a file
    written beside it now), until it is renewed or its age reaches `too_old` seconds; returns
    (the largest age, renewals seen)."""
    largest, renewals, last = 0.0, 0, path.stat().st_mtime
    while renewals == 0 and largest < too_old:
        now = path.with_name("now")
        now.write_text("")
        mtime = path.stat().st_mtime
        largest, renewals, last = max(largest, now.stat().st_mtime - mtime), renewals + (mtime != last), mtime
        now.unlink()
        time.sleep(0.25)
    return largest, renewals


def test_a_second_run_into_a_live_folder_is_refused_and_the_first_ends_as_if_alone(reference, tmp_path, start_slow_run):
    output_dir, release = tmp_path / "run", tmp_path / "release"
    first = start_slow_run(output_dir, release, hold_at=24)  # alive, whatever the second's start takes
    wait_for(checkpoint(output_dir, 4), first)
    owner = json.loads((output_dir / CLAIM_FILE).read_text())
    # A relaunch with another --lr: refused before it writes anything.
    second = run_training(output_dir, *ARGS, *TWO, "--lr", LR * 2, nproc=2, check=False)
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode != 0 and len(errors) == 1, second.stdout + second.stderr
    assert "belongs to a run in progress" in errors[0] and f"host {owner['host']}, pid {owner['pid']}" in errors[0]
    assert owner["job"] in errors[0]  # torchrun's run id names the job
    assert first.poll() is None, "the first run did not outlive the second's start"
    release.touch()
    assert first.wait(timeout=300) == 0, (output_dir.parent / "run.log").read_text()
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)
    assert config_value(output_dir / "config.toml", "lr") == LR  # the first run's config, not the second's
    assert not (output_dir / CLAIM_FILE).exists(), "the claim outlived its run"


def test_a_training_run_renews_its_claim_on_the_file_systems_clock(tmp_path):
    """While a run trains, its claim is renewed every heartbeat, as the file system's clock
    sees it: never near the age at which another machine's start takes it over (a heartbeat
    stopped or slowed past the staleness would hand a live run's folder to any other job).
    Watched until its first renewal (a heartbeat, 10 s), or until it is as old as no renewed
    claim gets: a stopped heartbeat fails then, not after a fixed wait."""
    output_dir = tmp_path / "run"
    command = training_command(output_dir, *ARGS, "--epochs", "50", probe="slow_until_released")
    run = subprocess.Popen(command, cwd=PROJECT, env=training_env({"RELEASE_FILE": str(tmp_path / "never")}),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        wait_for(output_dir / CLAIM_FILE, run)
        largest_age, renewals = claim_ages(output_dir / CLAIM_FILE, folder_claim.STALE_SECONDS / 8)
        assert run.poll() is None, "the run ended while its claim was watched"
    finally:
        kill_tree(run.pid)
        run.wait()
    assert renewals >= 1 and largest_age < folder_claim.STALE_SECONDS / 8, (largest_age, renewals)


def test_after_a_sigkill_of_the_whole_job_the_same_command_takes_over_and_resumes_exactly(
    reference, tmp_path, start_slow_run
):
    output_dir = tmp_path / "run"
    first = start_slow_run(output_dir, tmp_path / "never")
    wait_for(checkpoint(output_dir, 8), first)
    kill_tree(first.pid)  # torchrun and its workers at once: nothing lets go of the folder
    first.wait()
    dead = json.loads((output_dir / CLAIM_FILE).read_text())
    result = run_training(output_dir, *ARGS, *TWO, nproc=2, probe="float64")  # the same command
    assert f"took over {output_dir} from host {dead['host']}, pid {dead['pid']}" in result.stdout
    assert f"its process {dead['pid']} no longer exists" in result.stdout
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_a_run_whose_folder_was_taken_over_stops_and_the_new_owner_ends_as_if_alone(
    reference, tmp_path, start_slow_run
):
    """The first run, on another machine, stalls (SIGSTOP) past the claim's staleness; a job started
    here takes its folder over and trains; the first, continued, stops with one line naming
    the new owner before its next write there; the second ends bit for bit as if alone."""
    output_dir, first_log = tmp_path / "run", tmp_path / "first.log"
    first = start_slow_run(output_dir, tmp_path / "never", log=first_log, probe="fast_claim", another_machine=True)
    wait_for(checkpoint(output_dir, 4), first)
    stalled = stall(first)
    mine = json.loads((output_dir / CLAIM_FILE).read_text())
    release = tmp_path / "release"
    second = start_slow_run(output_dir, release, log=tmp_path / "second.log", probe="fast_claim", hold_at=24)
    deadline = time.monotonic() + 180
    while (taken := folder_claim.read_claim(output_dir / CLAIM_FILE)) is None or taken["token"] == mine["token"]:
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()
        time.sleep(0.1)
    # The second has resumed the first's checkpoints and trains on (slowly, until released).
    while "resumed from" not in (tmp_path / "second.log").read_text():
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()
        time.sleep(0.1)
    resume(stalled)
    assert first.wait(timeout=120) != 0, first_log.read_text()
    lines = [line for line in first_log.read_text().splitlines() if "no longer owns" in line]
    assert len(lines) == 1, first_log.read_text()
    assert f"taken over by host {taken['host']}, pid {taken['pid']}" in lines[0], lines[0]
    assert "no longer owns" not in (output_dir / "train.log").read_text()  # the second's log now
    release.touch()
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)
    assert not (output_dir / CLAIM_FILE).exists(), "the second run's claim outlived it"
    assert not list((output_dir / "checkpoints").glob(".*")), "a partial file was left behind"


def stall(process):
    """SIGSTOP `process` and its descendants (a paused VM, a host cut off); returns them, for `resume`."""
    stalled = [process.pid, *descendants(process.pid)]
    send(stalled, signal.SIGSTOP)
    return stalled


def resume(stalled):
    send(stalled, signal.SIGCONT)


def send(pids, signum):
    """`signum` to each of `pids` that still exists: one may end meanwhile (a rank whose stalled
    partner's heartbeat stopped leaves by itself, and torchrun reaps it), and needs no signal."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def wait_for_takeover(output_dir, token, second, second_log):
    """Until another run holds the claim that held `token`; returns the new owner."""
    deadline = time.monotonic() + 180
    while (taken := folder_claim.read_claim(output_dir / CLAIM_FILE)) is None or taken["token"] == token:
        assert second.poll() is None and time.monotonic() < deadline, second_log.read_text()
        time.sleep(0.1)
    return taken


def wait_for_line(text, path, process, seconds=180):
    """Until the file `path` (a run's output) holds `text`; fail at once if `process` ends first."""
    deadline = time.monotonic() + seconds
    while text not in path.read_text():
        assert process.poll() is None and time.monotonic() < deadline, path.read_text()
        time.sleep(0.1)


def stopped_alone(first, first_log, taken):
    """The stalled run's end, once continued: it fails, with one line naming the new owner."""
    assert first.wait(timeout=120) != 0, first_log.read_text()
    lines = [line for line in first_log.read_text().splitlines() if "no longer owns" in line]
    assert len(lines) == 1, first_log.read_text()
    assert f"taken over by host {taken['host']}, pid {taken['pid']}" in lines[0], lines[0]


def test_train_log_after_a_takeover_gets_no_line_of_the_stalled_run(tmp_path, start_slow_run):
    """A run stalled past the staleness and taken over, continued with no evaluation or
    checkpoint due for many steps: train.log, the new owner's file now, gets no line of it
    (its next line is dropped, as the heartbeat has not seen the claim for two beats), and it
    stops at its next step on every rank, with one line on its console naming the new owner."""
    output_dir, first_log, second_log = tmp_path / "run", tmp_path / "first.log", tmp_path / "second.log"
    first = start_slow_run(output_dir, tmp_path / "never", log=first_log, probe="fast_claim", another_machine=True,
                           args=["--log_every_steps", "1", "--checkpoint_every_steps", "0"])  # fmt: skip
    wait_for(output_dir / "train.log", first)
    wait_for_line("step 2 loss", output_dir / "train.log", first)
    stalled = stall(first)
    mine = json.loads((output_dir / CLAIM_FILE).read_text())
    second = start_slow_run(output_dir, tmp_path / "release", log=second_log, probe="fast_claim", hold_at=1)
    taken = wait_for_takeover(output_dir, mine["token"], second, second_log)
    wait_for_line("training ", second_log, second)  # its log lines before the first step are written
    before, console = (output_dir / "train.log").read_text(), len(first_log.read_text())
    resume(stalled)
    stopped_alone(first, first_log, taken)
    steps_after = re.findall(r"INFO step \d+ loss", first_log.read_text()[console:])
    assert len(steps_after) <= 3, first_log.read_text()[console:]  # not trained on to the epoch's end
    after = (output_dir / "train.log").read_text()
    assert after.startswith(before) and "step " not in after[len(before) :], after[len(before) :]
    assert "no longer owns" not in after
    assert second.poll() is None


def test_a_one_file_save_woken_between_write_and_rename_puts_nothing_in_place(tmp_path, start_slow_run):
    """The first run stalls (rank 0, its heartbeat with it) with its first checkpoint written
    under its temporary name, not yet renamed; a job started here takes the folder over; the
    first, continued, meets the last fence before the rename: its file is never put in place
    (nor left behind), and it stops with one line naming the new owner."""
    output_dir, first_log, second_log = tmp_path / "run", tmp_path / "first.log", tmp_path / "second.log"
    first = start_slow_run(output_dir, tmp_path / "never", log=first_log, probe="fast_claim,stall_before_rename",
                           another_machine=True)  # fmt: skip
    wait_for_line("PROBE checkpoint written, not renamed", first_log, first)
    mine = json.loads((output_dir / CLAIM_FILE).read_text())
    second = start_slow_run(output_dir, tmp_path / "release", log=second_log, probe="fast_claim", hold_at=2)
    taken = wait_for_takeover(output_dir, mine["token"], second, second_log)
    wait_for_line("training ", second_log, second)
    written = list((output_dir / "checkpoints").glob(".*.tmp"))
    assert len(written) == 1, written  # the first's checkpoint, written, not in place
    resume([first.pid, *descendants(first.pid)])
    stopped_alone(first, first_log, taken)
    assert not list((output_dir / "checkpoints").iterdir()), list((output_dir / "checkpoints").iterdir())
    assert second.poll() is None


@pytest.mark.parametrize("stalled_at", ["write", "fence"])
def test_an_fsdp_takeover_during_a_save_leaves_the_new_owners_save_whole(tmp_path, start_slow_run, stalled_at):
    """--strategy fsdp: the first run is stalled in its save of step 8, its temporary folder
    made, in DCP's write (`write`) or before the ranks' fence (`fence`); a job started here
    takes the folder over, resumes step 4 and saves step 8 too, held half-way; the first,
    continued, stops with one line naming the new owner: stalled before its fence, no rank
    writes a shard; in either case the new owner's temporary folder is neither written into
    nor removed, and its step 8 is a whole checkpoint."""
    output_dir, first_log, second_log = tmp_path / "run", tmp_path / "first.log", tmp_path / "second.log"
    wake, release = tmp_path / "wake", tmp_path / "release"
    fsdp, probe = ["--strategy", "fsdp", "--epochs", "1"], "fast_claim,hold_sharded_save"
    holds = {"HOLD_SAVE_STEP": "8", "HOLD_SAVE_AT": stalled_at}
    first = start_slow_run(output_dir, tmp_path / "never", log=first_log, probe=probe, another_machine=True, args=fsdp,
                           env={**holds, "HOLD_SAVE_RELEASE": str(wake)})  # fmt: skip
    wait_for_line("PROBE holding the save of step_000000008", first_log, first)
    if stalled_at == "write":  # rank 1 too, not stalled on its way there
        wait_for_line("PROBE rank 1 writes the shards of step_000000008", first_log, first)
    stalled = stall(first)
    mine = json.loads((output_dir / CLAIM_FILE).read_text())
    second = start_slow_run(output_dir, release, log=second_log, probe=probe, args=fsdp,
                            env={**holds, "HOLD_SAVE_AT": "write", "HOLD_SAVE_RELEASE": str(release)})  # fmt: skip
    taken = wait_for_takeover(output_dir, mine["token"], second, second_log)
    wait_for_line("PROBE holding the save of step_000000008", second_log, second)
    console = len(first_log.read_text())
    wake.touch()
    resume(stalled)
    stopped_alone(first, first_log, taken)
    assert "writes the shards" not in first_log.read_text()[console:]  # fenced on every rank
    release.touch()
    wait_for(output_dir / "checkpoints" / "step_000000008", second)
    state = load_checkpoint(output_dir / "checkpoints" / "step_000000008")  # every shard there, trainer.pt too
    assert state["step"] == 8
    assert second.wait(timeout=300) == 0, second_log.read_text()
    assert not list((output_dir / "checkpoints").glob(".*")), "a partial folder was left behind"


def config_value(path, name):
    """Field `name` of a config.toml, whichever table holds it."""
    tables = [tomllib.loads(path.read_text())]
    while tables:
        table = tables.pop()
        if name in table:
            return table[name]
        tables += [value for value in table.values() if isinstance(value, dict)]
    raise KeyError(name)


# --- the rules, on claims written by hand (no training) ----------------------------------


@pytest.fixture
def fast_claims(monkeypatch):
    """Heartbeats and staleness in fractions of a second."""
    monkeypatch.setattr(folder_claim, "BEAT_SECONDS", 0.05)
    monkeypatch.setattr(folder_claim, "STALE_SECONDS", 1.0)


def write_claim(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    owner = {"job": "job A", "host": "node7", "pid": 4242, "started": "2026-01-01T00:00:00+00:00",
             "machine": "node7 another-boot pid:[1]", "process_start": 99, "token": "theirs", **fields}  # fmt: skip
    (folder / CLAIM_FILE).write_text(json.dumps(owner))
    return folder / CLAIM_FILE


def take(folder, job="job B", wait_seconds=5.0):
    said = []
    claim = Claim.take(folder, job, wait_seconds, said.append)
    claim.release()
    return claim, said


def age(path, seconds):
    """Make the claim look last renewed `seconds` ago."""
    past = time.time() - seconds
    os.utime(path, (past, past))


@pytest.fixture
def renewing():
    """Renew a claim from a thread, as its owner's heartbeat would (each renewal another time,
    all of them `seconds_ago` in the past: the owner's clock may be behind); returns the
    thread's stop event."""
    stops = []

    def start(path, seconds_ago=0.0):
        stop = threading.Event()
        stops.append(stop)

        def beat():
            step = 0
            while not stop.wait(0.01):
                step += 1
                past = time.time() - seconds_ago + step * 1e-3
                os.utime(path, (past, past))

        threading.Thread(target=beat, daemon=True).start()
        return stop

    yield start
    for stop in stops:
        stop.set()


def test_a_live_claim_from_another_machine_refuses_another_job(tmp_path, fast_claims, renewing):
    path = write_claim(tmp_path)
    renewing(path).set()  # renewed a moment ago
    time.sleep(0.05)
    with pytest.raises(ClaimRefused, match=r"belongs to a run in progress \(host node7, pid 4242, .*job A\)"):
        take(tmp_path)
    # Looking old on the file system's clock, but renewed while watched: alive (clocks differ).
    renewing(path, seconds_ago=100)
    time.sleep(0.05)
    with pytest.raises(ClaimRefused):
        take(tmp_path)


def test_a_claim_from_another_machine_not_renewed_is_taken_over(tmp_path, fast_claims):
    path = write_claim(tmp_path)
    age(path, 100)
    claim, _ = take(tmp_path)
    assert claim.note.startswith(f"took over {tmp_path} from host node7, pid 4242")
    assert "not renewed for" in claim.note
    assert not path.exists()  # released by take()


def test_a_dead_process_or_a_damaged_claim_on_this_machine_is_taken_over(tmp_path, fast_claims):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    path = write_claim(tmp_path, pid=ended.pid, machine=folder_claim.machine_identity(),
                       process_start=folder_claim.process_start(os.getpid()))  # fmt: skip
    claim, _ = take(tmp_path)
    assert f"its process {ended.pid} no longer exists" in claim.note
    path.write_text("{half a claim")
    claim, _ = take(tmp_path)
    assert "damaged" in claim.note


def test_an_earlier_start_of_the_same_job_is_waited_for_then_refused(tmp_path, fast_claims, renewing):
    path = write_claim(tmp_path, job="job B", pid=os.getpid(), machine=folder_claim.machine_identity(),
                       process_start=folder_claim.process_start(os.getpid()))  # fmt: skip
    threading.Timer(0.5, path.unlink).start()  # the old start checkpoints and lets go
    claim, said = take(tmp_path, job="job B")
    assert claim.note is None and len(said) == 1 and said[0].startswith("waiting up to 5.0 s for the earlier start")
    write_claim(tmp_path, job="job B", pid=os.getpid(), machine=folder_claim.machine_identity(),
                process_start=folder_claim.process_start(os.getpid()))  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ClaimRefused):
        take(tmp_path, job="job B", wait_seconds=1.0)  # still held when the wait ends
    assert time.monotonic() - started >= 1.0


def test_a_run_lets_go_of_its_own_claim_only(tmp_path, fast_claims):
    mine = Claim.take(tmp_path, "job B", 1.0, print)
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["token"] == mine.owner["token"]
    (tmp_path / CLAIM_FILE).unlink()
    write_claim(tmp_path)  # another run took the folder over while this one was stalled
    mine.release()
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["token"] == "theirs"


def test_a_lost_reply_to_the_claims_link_is_still_this_runs_claim(tmp_path, monkeypatch):
    """NFS: the reply to a hard link that succeeded is lost, and the client's retry answers
    EEXIST. The claim is read back: this run's own, not a run in progress to wait for."""
    link = os.link

    def link_reply_lost(source, target):
        link(source, target)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(os, "link", link_reply_lost)
    claim = Claim.take(tmp_path, "job B", 1.0, print)
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["token"] == claim.owner["token"]
    claim.release()
    assert not (tmp_path / CLAIM_FILE).exists()


def test_a_file_system_without_hard_links_still_claims_once(tmp_path, monkeypatch):
    """Without hard links (EPERM), the claim is created only if absent: this run takes the
    folder, and a second start into it is refused."""

    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    claim = Claim.take(tmp_path, "job B", 1.0, print)
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["token"] == claim.owner["token"]
    with pytest.raises(ClaimRefused, match="belongs to a run in progress"):
        Claim.take(tmp_path, "job C", 1.0, print)
    claim.release()


@pytest.mark.parametrize(
    ("environ", "job"),
    [
        ({"SLURM_JOB_ID": "812", "TORCHELASTIC_RUN_ID": "ddp"}, "SLURM job 812"),  # a requeue keeps it
        ({"TRAINING_JOB_ID": "k8s:team/train", "TORCHELASTIC_RUN_ID": "none"}, "k8s:team/train"),
        ({"TORCHELASTIC_RUN_ID": "3f2c"}, "torchrun run 3f2c"),  # --standalone: one per torchrun command
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # a static rendezvous names no job
        ({}, None),  # python train.py
    ],
)
def test_each_launcher_names_its_job(environ, job):
    assert job_identity(environ) == job
