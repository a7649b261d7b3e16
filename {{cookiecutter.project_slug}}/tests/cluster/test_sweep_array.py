"""A sweep from a SLURM job array (docs/sweeps.md): two array tasks, each a sweep.py worker on
the journal file of one folder, on the cluster of tests/cluster/slurm_cluster.py; the second
task's worker SIGKILLed mid-trial. Every trial ends (completed, pruned or failed with its
reason), none lost: the dead worker's trial is run again by the other task, in its folder."""

import csv
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT
from slurm_cluster import slurm_fixture  # noqa: F401 (the `slurm` fixture)
from test_sweep import GRID, processes_of, sweep_file

pytest.importorskip("optuna", reason='sweeps need the sweep extra: pip install -e ".[sweep]"')
pytestmark = pytest.mark.fixed_amp


def worker_pid(task_id):
    """The PID of the sweep.py worker of array task `task_id`, or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sweep.py" in cmdline and f"SLURM_ARRAY_TASK_ID={task_id}".encode() in environ:
            return int(entry.name)
    return None


def test_a_sweep_from_a_job_array_loses_no_trial_to_a_killed_worker(slurm, tmp_path):
    folder = tmp_path / "sweep"
    path = sweep_file(tmp_path / "lr.toml", folder, [("lr", "grid", GRID)])
    env = slurm.env({"OMP_NUM_THREADS": 1}, path_first=[Path(sys.executable).parent])
    command = f"{sys.executable} sweep.py {path}"
    job = slurm.sbatch(["--array=0-1", "--ntasks=1", f"--output={folder.parent}/worker_%a.out", "--wrap", command],
                       env=env, cwd=PROJECT)  # fmt: skip
    deadline = time.monotonic() + 180
    killed_dir = None
    while killed_dir is None and time.monotonic() < deadline:  # the second task's first trial, training
        log = folder.parent / "worker_1.out"
        started = [line for line in log.read_text().splitlines() if "--lr" in line] if log.exists() else []
        if started:
            number = int(started[0].split()[2])
            trial_dir = folder / "trials" / f"trial_{number:04d}"
            if (trial_dir / "metrics.jsonl").exists():
                killed_dir = trial_dir
        time.sleep(0.2)
    assert killed_dir is not None, slurm.logs()
    os.kill(worker_pid(1), signal.SIGKILL)
    deadline = time.monotonic() + 600  # the retry may wait out the dead run's claim (another host's)
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(2)
    assert not slurm.jobs(), f"the array did not end\n{slurm.logs()}"
    assert not processes_of(killed_dir)
    with open(folder / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    counted = [r for r in rows if not (r["state"] == "fail" and "run again" in r["reason"])]
    worker_0 = (folder.parent / "worker_0.out").read_text()
    assert len(counted) == len(GRID) and sorted(float(r["lr"]) for r in counted) == sorted(GRID), (rows, worker_0)
    assert all(r["state"] == "complete" or r["reason"] for r in rows), rows
    (dead,) = [r for r in rows if "no heartbeat" in r["reason"]]
    assert Path(dead["output_dir"]) == killed_dir
    (retry,) = [r for r in rows if r["retry_of"] == dead["trial"]]
    assert retry["state"] in ("complete", "pruned", "fail") and retry["output_dir"] == dead["output_dir"]
    assert job  # the array's id, for the record
