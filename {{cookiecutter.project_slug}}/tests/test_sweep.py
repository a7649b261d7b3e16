"""Sweeps (sweep.py, ddp_utils/sweep*.py): a study of short training runs from several workers
on one storage, one worker killed mid-trial, every trial ended with its reason, the results
written; bad sweep files in one line. Needs the sweep extra (Optuna, matplotlib)."""

import csv
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LR, PROJECT, TINY_CONFIG, read_metrics, run_training, saved_step, training_env

from config import Config
from ddp_utils.configuration import toml_value
from ddp_utils.sweep.run import main as sweep_main
from task import TASK

pytest.importorskip("optuna", reason='sweeps need the sweep extra: pip install -e ".[sweep]"')
pytestmark = pytest.mark.fixed_amp

# Each trial's steps, evaluated every EVAL_EVERY: the second worker is killed at its first trial's
# first evaluation, 90 steps before that trial would end.
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


def sweep_file(path, folder, knobs, trials=None, metric="val_loss", **extra):
    lines = ["[sweep]", f'folder = "{folder}"', f"steps = {STEPS}", f'metric = "{metric}"', "heartbeat_seconds = 2"]
    lines += ["startup_trials = 1"] + ([f"trials = {trials}"] if trials else [])
    lines += [f"{key} = {toml_value(value)}" for key, value in extra.items()]
    lines += ["", "[knobs]", *(knob_line(*knob) for knob in knobs), "", "[flags]"]
    lines += [f"{name} = {toml_value(value)}" for name, value in FLAGS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def knob_line(name, kind, values):
    """`name = { kind = [values] }`: a knob's range in TOML."""
    return f"{name} = " + "{ " + f"{kind} = [{', '.join(map(toml_value, values))}]" + " }"


def start_worker(path, log):
    return subprocess.Popen([sys.executable, "sweep.py", str(path)], cwd=PROJECT, env=training_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # fmt: skip


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
            for trial_dir in (folder / "trials").glob("trial_*") if (folder / "trials").exists() else []:
                mine = [p for p in processes_of(trial_dir) if os.getppid() != p]
                metrics = trial_dir / "metrics.jsonl"
                if metrics.exists() and mine and any(second.pid == ppid(p) for p in mine):
                    killed_dir, killed = trial_dir, set(mine)
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


def test_the_best_config_reproduces_its_trial_and_the_pictures_are_written(swept, tmp_path):
    folder, path, _ = swept
    rows = read_rows(folder)
    best = min((r for r in rows if r["state"] == "complete"), key=lambda r: float(r["val_loss"]))
    again = tmp_path / "again"
    run_training(again, "--config", folder / "best_config.toml", tiny=False)
    assert read_metrics(again)[-1]["val_loss"] == float(best["val_loss"])  # same seed, same processes: to the bit
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
