"""Sweeps (sweep.py, ddp_utils/sweep*.py): a study of short training runs from several workers
on one storage, one worker stopped for a while and one killed mid-trial, every trial ended with
its reason, the results written and the best rerun by its own line; workers with one pid; bad
sweep files in one line. Needs the sweep extra (Optuna, matplotlib)."""

import csv
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import LR, PROJECT, TINY_CONFIG, kill_tree, read_metrics, run_training, saved_step, training_env

from config import Config
from ddp_utils.configuration import toml_value
from ddp_utils.sweep.file import read_sweep
from ddp_utils.sweep.results import write_file
from ddp_utils.sweep.run import load_study, open_storage, suggest
from ddp_utils.sweep.run import main as sweep_main
from task import TASK

pytest.importorskip("optuna", reason='sweeps need the sweep extra: pip install -e ".[sweep]"')
pytestmark = pytest.mark.fixed_amp

# Each trial's steps, evaluated every EVAL_EVERY: the second worker is killed (or stopped) at its
# first trial's first evaluation, 90 steps before that trial would end.
STEPS, EVAL_EVERY = 100, 10
# The TINY runs' flags (the task's own tiny sizes and data), as a sweep's [flags] table.
SKIP = {"output_dir", "max_steps", "epochs", "lr"}
FLAGS = {
    f.name: getattr(TINY_CONFIG, f.name)
    for f in dataclasses.fields(Config)
    if getattr(TINY_CONFIG, f.name) != f.default and f.name not in SKIP
}
FLAGS.update(eval_every_steps=EVAL_EVERY, amp="none", progress_bar=False)
# The task's own tiny lr and half of it, two rates that cannot learn in STEPS (the pruner
# stops them once a trial has completed) and one that overflows any model (a failed trial). Each
# point is a run of its own, most of its time the start of Python and torch: five, not more. The
# grid's order is the seeded sampler's, the same for every task and every worker: its first two
# points, the two workers' first trials (started together: neither is pruned, no trial having
# completed), are HOPELESS[0] and LR, both still training when the second worker is killed at
# its trial's first evaluation; DIVERGES would fail before writing one.
HOPELESS = [LR * 1e-6, LR * 1e-7]
DIVERGES = 1e30
GRID = [LR, LR / 2, *HOPELESS, DIVERGES]


def sweep_file(path, folder, knobs, trials=None, metric="val_loss", steps=STEPS, **extra):
    lines = ["[sweep]", f'folder = "{folder}"', f"steps = {steps}", f'metric = "{metric}"', "heartbeat_seconds = 2"]
    lines += ["startup_trials = 1"] + ([f"trials = {trials}"] if trials else [])
    lines += [f"{key} = {toml_value(value)}" for key, value in extra.items()]
    lines += ["", "[knobs]", *(knob_line(*knob) for knob in knobs), "", "[flags]"]
    lines += [f"{name} = {toml_value(value)}" for name, value in FLAGS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def knob_line(name, kind, values):
    """`name = { kind = [values] }`: a knob's range in TOML."""
    return f"{name} = " + "{ " + f"{kind} = [{', '.join(map(toml_value, values))}]" + " }"


# sweep.py on a host whose clock is an hour behind this one's (its trials' runs on the true clock).
CLOCK_BEHIND = (
    "import runpy, sys, time; true_time = time.time; time.time = lambda: true_time() - 3600; "
    "sys.argv = ['sweep.py', *sys.argv[1:]]; runpy.run_path('sweep.py', run_name='__main__')"
)


def start_worker(path, log, clock_behind=False):
    command = [sys.executable, *(["-c", CLOCK_BEHIND] if clock_behind else ["sweep.py"]), str(path)]
    return subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)  # fmt: skip


def wait_for_line(log, text, worker, seconds):
    """The first line of `log` holding `text`; fails when `worker` ends first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [line for line in log.read_text().splitlines() if text in line]
        if found:
            return found[0]
        assert worker.poll() is None, f"the worker ended ({worker.returncode}):\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no line with {text!r} in {log}:\n{log.read_text()}")


def trial_training(folder, worker, skip=None):
    """(a trial's folder, its processes) while `worker` trains it past its first evaluation, or
    (None, set()); not the folder `skip`."""
    for trial_dir in (folder / "trials").glob("trial_*") if (folder / "trials").exists() else []:
        mine = [p for p in processes_of(trial_dir) if os.getppid() != p]
        metrics = trial_dir / "metrics.jsonl"
        if trial_dir != skip and metrics.exists() and mine and any(worker.pid == ppid(p) for p in mine):
            return trial_dir, set(mine)
    return None, set()


def processes_of(folder):
    """PIDs whose command line names `folder` (a trial's launcher and its training processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def read_rows(folder):
    with open(folder / "trials.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A trial for each point of a grid over --lr (GRID) from 2 workers on this machine; the
    second is SIGKILLed while its first trial trains. Returns (folder, sweep file, the killed
    trial's folder)."""
    tmp = tmp_path_factory.mktemp("sweep")
    folder = tmp / "sweep"
    path = sweep_file(tmp / "lr.toml", folder, [("lr", "grid", GRID)])
    first = start_worker(path, tmp / "first.log")
    second = start_worker(path, tmp / "second.log")
    try:
        deadline = time.monotonic() + 120
        killed_dir, killed = None, set()
        while killed_dir is None and time.monotonic() < deadline:
            killed_dir, killed = trial_training(folder, second)
            time.sleep(0.2)
        assert killed_dir is not None, (tmp / "second.log").read_text()
        second.send_signal(signal.SIGKILL)
        second.wait()
        # Its trial stops as a preemption does: a checkpoint, then the exit, long before its last
        # step. (Its own processes: the other worker's retry of it runs in the same folder.)
        deadline = time.monotonic() + 60
        while killed & set(processes_of(killed_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not killed & set(processes_of(killed_dir)), "the killed worker's trial trains on"
        assert saved_step(killed_dir)[0] < STEPS, "the killed worker's trial trained on to its last step"
        assert first.wait(timeout=600) == 0, (tmp / "first.log").read_text()
    finally:
        for worker in (first, second):
            if worker.poll() is None:
                worker.kill()
    return folder, path, killed_dir


def ppid(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_every_trial_ends_with_its_reason_and_none_is_lost(swept):
    folder, _, killed_dir = swept
    rows = read_rows(folder)
    counted = [r for r in rows if not (r["state"] == "fail" and "run again" in r["reason"])]
    # Every grid point once, none lost to the killed worker.
    assert len(counted) == len(GRID), rows
    assert sorted(float(r["lr"]) for r in counted) == sorted(GRID), rows
    assert {r["state"] for r in counted} <= {"complete", "pruned", "fail"}
    for row in rows:
        assert row["state"] == "complete" or row["reason"], row
    # The killed worker's trial: failed by the heartbeat, run again in its own folder.
    (dead,) = [r for r in rows if "no heartbeat" in r["reason"]]
    assert Path(dead["output_dir"]) == killed_dir
    retries = [r for r in rows if r["retry_of"] == dead["trial"]]
    assert len(retries) == 1 and retries[0]["output_dir"] == dead["output_dir"], rows
    # The overflowing rate failed with the run's own root cause.
    (diverged,) = [r for r in counted if float(r["lr"]) == DIVERGES]
    assert diverged["state"] == "fail" and "not finite" in diverged["reason"], diverged
    # A pruned trial was stopped as a preemption is: before its last step, its checkpoint kept.
    pruned = [r for r in counted if r["state"] == "pruned"]
    assert pruned, rows
    for row in pruned:
        out = Path(row["output_dir"])
        assert read_metrics(out)[-1]["step"] < STEPS
        assert (out / "checkpoints" / "last.pt").exists()
    # A rate that cannot learn is pruned, unless it ran before any trial completed.
    first_done = min(int(r["trial"]) for r in counted if r["state"] == "complete")
    assert all(
        r["state"] == "pruned" for r in counted if float(r["lr"]) in HOPELESS and int(r["trial"]) > first_done + 1
    )


# The stopped worker's trial: long enough that its run trains on well past three heartbeats.
STALLED_STEPS = 400


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """A sweep of one trial from 2 workers, the one that runs it on a clock an hour behind the
    other's (as on another host): stopped (SIGSTOP, as Ctrl-Z does) past its trial's first
    evaluation, its run training on, until the other worker has failed that trial, then woken
    (SIGCONT). Returns (folder, the trial's folder, the last step its run had written when the
    trial was failed, the line the worker printed once woken, its pid)."""
    tmp = tmp_path_factory.mktemp("stalled")
    folder = tmp / "sweep"
    path = sweep_file(tmp / "lr.toml", folder, [("lr", "choices", [LR])], trials=1, steps=STALLED_STEPS)
    second = start_worker(path, tmp / "second.log", clock_behind=True)
    first = None
    try:
        wait_for_line(tmp / "second.log", "sweep.py: trial 0", second, 120)  # the trial is the second's
        first = start_worker(path, tmp / "first.log")
        deadline = time.monotonic() + 120
        stalled_dir = None
        while stalled_dir is None and time.monotonic() < deadline:
            stalled_dir, _ = trial_training(folder, second)
            time.sleep(0.2)
        assert stalled_dir is not None, (tmp / "second.log").read_text()
        second.send_signal(signal.SIGSTOP)
        wait_for_line(tmp / "first.log", f"pid {second.pid}) stopped: no heartbeat", first, 300)
        stalled_steps = read_metrics(stalled_dir)[-1]["step"]
        second.send_signal(signal.SIGCONT)
        woken = wait_for_line(tmp / "second.log", "was failed by another worker", second, 120)
        for worker, log in ((first, "first.log"), (second, "second.log")):
            assert worker.wait(timeout=300) == 0, (tmp / log).read_text()
    finally:
        for worker in (first, second):
            if worker is not None and worker.poll() is None:
                worker.send_signal(signal.SIGCONT)
                worker.kill()
    return folder, stalled_dir, stalled_steps, woken, second.pid


def test_a_stopped_worker_keeps_its_trials_result_and_goes_on(stalled):
    """A worker stopped for over three heartbeats (Ctrl-Z, a slow journal) while its run trains
    on: its trial is failed only once the run has ended at its last step, and run again in its
    folder, which resumes there: the values the run wrote are the trial's result. Woken, the
    worker says so in one line and goes on with the sweep to its end. Its clock, an hour behind
    the other's, is never compared: its trial was not failed while it beat."""
    folder, stalled_dir, stalled_steps, woken, pid = stalled
    rows = read_rows(folder)
    assert stalled_steps == STALLED_STEPS, "the stopped worker's trial was failed while its run trained"
    failed, retry = rows
    assert failed["state"] == "fail" and Path(failed["output_dir"]) == stalled_dir, rows
    assert "no heartbeat" in failed["reason"] and f"pid {pid})" in failed["reason"], failed
    assert f"trial {failed['trial']} was failed by another worker" in woken, woken
    assert retry["retry_of"] == failed["trial"] and Path(retry["output_dir"]) == stalled_dir, retry
    written = {line["step"]: line["val_loss"] for line in read_metrics(stalled_dir) if "val_loss" in line}
    assert retry["state"] == "complete" and float(retry["val_loss"]) == written[STALLED_STEPS], (retry, written)


def test_the_best_config_reproduces_its_trial_and_the_pictures_are_written(swept, tmp_path):
    folder, path, _ = swept
    rows = read_rows(folder)
    best = min((r for r in rows if r["state"] == "complete"), key=lambda r: float(r["val_loss"]))
    # Its own rerun line, as a user runs it: the trial's processes (launch.sh's default is the
    # project's gpus_per_node), the same seed: to the bit. It trains into the sweep's best/.
    (line,) = [line for line in (folder / "best_config.toml").read_text().splitlines() if "Rerun it with: " in line]
    command = line.split("Rerun it with: ", 1)[1]
    rerun = subprocess.Popen(["bash", "-c", command], cwd=PROJECT, env=training_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output = rerun.communicate(timeout=300)[0]
    finally:
        kill_tree(rerun.pid)
    assert rerun.returncode == 0, output
    again = folder / "best"
    assert read_metrics(again)[-1]["val_loss"] == float(best["val_loss"]), output
    # The dead worker's trial, resumed in its folder by the other worker, equals the same trial
    # run alone, at every evaluation both made.
    (dead,) = [r for r in rows if "no heartbeat" in r["reason"]]
    alone = tmp_path / "alone"
    run_training(alone, "--config", Path(dead["output_dir"]) / "config.toml", "--max_steps", STEPS, tiny=False)
    resumed = {line["step"]: line["val_loss"] for line in read_metrics(dead["output_dir"])}
    fresh = {line["step"]: line["val_loss"] for line in read_metrics(alone)}
    assert resumed and all(fresh[step] == value for step, value in resumed.items()), (resumed, fresh)
    for picture in ("metric_vs_knobs.png", "best_curves.png"):
        assert (folder / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture
    # The same command again continues the study: it is done, so no trial is added.
    result = subprocess.run([sys.executable, "sweep.py", str(path)], cwd=PROJECT, env=training_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(read_rows(folder)) == len(rows)
    # Any runs' loss curves side by side.
    out = tmp_path / "curves.png"
    assert sweep_main(TASK, ["--curves", best["output_dir"], str(again), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_metric_the_task_does_not_report_is_one_line(tmp_path):
    """sweep.py as a user runs it (its own process, this interpreter's environment): the first
    trial's first evaluation line lacks the metric, so the worker stops that trial and says so in
    one line, naming the metric the task reports."""
    path = sweep_file(tmp_path / "m.toml", tmp_path / "s", [("lr", "choices", [LR])], trials=1,
                      metric="val_los")  # fmt: skip
    result = subprocess.run([sys.executable, "sweep.py", str(path)], cwd=PROJECT, env=training_env(),
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    trial_log = "".join(log.read_text() for log in sorted((tmp_path / "s" / "logs").glob("*.log")))
    assert result.returncode == 2, result.stdout + result.stderr + trial_log
    (line,) = result.stderr.strip().splitlines()
    assert "sweep.metric val_los is not reported by the task (did you mean val_loss?)" in line, line


@pytest.mark.parametrize(
    "knob, extra, message",
    [
        (("lrr", "log_uniform", [1e-4, 1e-2]), {}, "unknown key knobs.lrr (did you mean lr?)"),
        (("batch_size", "uniform", [8, 32]), {}, "uniform draws numbers, but batch_size is an integer: use int"),
        (("lr", "log_uniform", [0.0, 1e-2]), {}, "must start above 0"),
        (("lr", "choices", [-1.0]), {}, "knobs.lr: -1.0 is refused: --lr must be greater than 0"),
        (("lr", "log_uniform", [1e-4, 1e-2]), {"storage": "sqlite:////nonexistent/folder/s.db"}, "cannot open it"),
        (("lr", "log_uniform", [1e-4, 1e-2]), {"pruner": "medain"}, "sweep.pruner must be one of median, none"),
    ],
)
def test_bad_sweep_files_are_one_line(tmp_path, capsys, knob, extra, message):
    path = sweep_file(tmp_path / "bad.toml", tmp_path / "s", [knob], trials=2, **extra)
    assert sweep_main(TASK, [str(path)], root=PROJECT) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {path}") and message in line, line


def test_a_storage_urls_password_is_never_printed(tmp_path, capsys):
    """Error lines land in SLURM's output files, which others on a shared cluster often read: the
    storage URL is shown with its password masked, in the line and in the driver's own words."""
    url = "postgresql://sweeper:s3cret%2Fpw@localhost:1/sweeps"
    path = sweep_file(tmp_path / "db.toml", tmp_path / "s", [("lr", "log_uniform", [1e-4, 1e-2])], trials=2,
                      storage=url)  # fmt: skip
    assert sweep_main(TASK, [str(path)], root=PROJECT) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert "s3cret" not in err and "sweep.storage postgresql://sweeper:***@localhost:1/sweeps: cannot open it" in line
    from ddp_utils.sweep.run import masked

    quoted = masked(f"cannot parse {url}, nor postgresql://sweeper:s3cret/pw@localhost:1/sweeps", url)
    assert "s3cret" not in quoted and quoted.count("sweeper:***@localhost") == 2, quoted


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_workers_with_one_pid_draw_their_own_parameters(tmp_path, sampler):
    """Workers in containers often have one pid (1 in each). Two workers' samplers, made in this
    process, whose pid they share for real: one seed in the file, yet their first draws differ."""
    path = sweep_file(tmp_path / "s.toml", tmp_path / "s", [("lr", "log_uniform", [1e-5, 1e-1])], trials=4,
                      sampler=sampler)  # fmt: skip
    sweep = read_sweep(path, Config)
    storage, _ = open_storage(sweep)
    first, second = (suggest(load_study(sweep, storage).ask(), sweep.knobs) for _ in range(2))
    assert first != second


def test_workers_with_one_pid_write_the_results_whole(tmp_path):
    """Two writers of one pid (threads of this process) write a results file at once, again and
    again: neither fails, and a reader always finds one of them whole."""
    path = tmp_path / "trials.csv"
    payloads = [letter * 2**19 for letter in (b"a", b"b")]
    write_file(path, payloads[0])
    problems = []

    def write(data):
        try:
            for _ in range(100):
                write_file(path, data)
        except OSError as error:
            problems.append(repr(error))

    writers = [threading.Thread(target=write, args=(data,)) for data in payloads]
    for writer in writers:
        writer.start()
    while any(writer.is_alive() for writer in writers):
        if path.read_bytes() not in payloads:
            problems.append("a file not whole")
    for writer in writers:
        writer.join()
    assert not problems, problems[:3]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("path", sorted((PROJECT / "experiments").glob("sweep_*.toml")), ids=lambda p: p.name)
def test_the_example_sweep_files_are_valid(path, monkeypatch):
    """experiments/sweep_*.toml read as sweep.py reads them: every knob and flag a Config field."""

    from ddp_utils.errors import InputError
    from ddp_utils.sweep.file import read_sweep

    monkeypatch.chdir(PROJECT)  # the files' paths are relative to the project folder
    try:
        sweep = read_sweep(path, Config)
    except InputError as error:
        pytest.fail(str(error))
    assert sweep.trials >= 2 and sweep.knobs
