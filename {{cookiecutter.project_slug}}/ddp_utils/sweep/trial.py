"""One trial of a sweep: a normal training run through scripts/launch.sh (so it may use several
processes), its metrics.jsonl followed while it runs, stopped the way a preemption is when the
sweep says so, and how it ended in one line.

A trial's processes die with the worker that started them: the launcher gets SIGTERM when its
parent dies (Linux's PR_SET_PDEATHSIG), the stop signal the run already handles, so a worker
killed outright (SIGKILL, an array task cancelled) leaves the trial's checkpoint behind and no
process training on. Its trial is then retried by another worker, resuming that checkpoint.
"""

import ctypes
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent():
    """In the child, before exec: SIGTERM when the worker that started it dies (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a killed worker's trial runs on to its end
        pass


def trial_job(sweep_name, first):
    """The job every attempt of a trial runs as (its run's TRAINING_JOB_ID): `first` is the
    number of the trial's first attempt, whose folder they share."""
    return f"sweep {sweep_name} trial {first}"


def run_holds_folder(folder, job):
    """Whether a run of `job` holds `folder` and lives (its claim, ddp_utils/train/folder_claim.py):
    on this machine its process exists; on another, its claim was renewed within STALE_SECONDS on
    the file system's own clock, so no two hosts' clocks are compared. A trial whose worker fell
    silent (stopped by Ctrl-Z, stalled on a slow journal) while its run trains on keeps its run."""
    from ..train.folder_claim import CLAIM_FILE, STALE_SECONDS, claim_age, machine_identity, process_alive, read_claim

    path = Path(folder) / CLAIM_FILE
    try:
        owner = read_claim(path)
        if owner is None or owner.get("job") != job or "pid" not in owner:
            return False
        if owner.get("machine") == machine_identity():
            return process_alive(owner)
        age = claim_age(path)
    except OSError:  # unreadable: taken for gone, as the worker's silence says
        return False
    return age is not None and age < STALE_SECONDS


def start_trial(root, argv, log_path, processes, job):
    """Start `scripts/launch.sh argv` in the project folder `root`; its output goes to `log_path`
    (appended: a retry's output follows the first attempt's). `job` names the trial to the
    output-folder claim, so a retry waits for a dying attempt to let go of its folder."""
    env = dict(os.environ, NNODES="1", NPROC_PER_NODE=str(processes), TRAINING_JOB_ID=job)
    env.pop("MASTER_ADDR", None)  # this machine only (launch.sh's --standalone: a free port)
    env.pop("SLURM_JOB_ID", None)  # the trial's own job, not the array task's, names its claim
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            ["bash", str(Path(root) / "scripts" / "launch.sh"), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C at the worker's terminal is the worker's to forward
            preexec_fn=die_with_parent,
        )


def stop(process):
    """The stop signal a preemption sends: the run saves its checkpoint and exits (143)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)


def evaluation_lines(metrics_path):
    """metrics.jsonl's evaluation lines (those with val_samples), whole lines only."""
    lines = []
    try:
        text = Path(metrics_path).read_text()
    except OSError:
        return lines
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # being written
            continue
        if isinstance(record, dict) and "step" in record and "val_samples" in record:
            lines.append(record)
    return lines


def reported_metrics(record):
    """The numbers a metrics line reports, by name (what a sweep's metric may be)."""
    skip = {"epoch", "step", "val_samples"}
    return sorted(k for k, v in record.items() if k not in skip and isinstance(v, (int, float)))


def is_finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def failure_reason(log_path, code, offset=0):
    """The run's own root cause, from its output past `offset` (this attempt's): its first
    `error:` line, else its first ERROR line (the root cause is logged first), else the last
    line it printed; with the exit status."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        text = ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    logged = [line for line in lines if " ERROR " in line]
    why = errors[0] if errors else logged[0] if logged else lines[-1] if lines else "no output"
    return f"exit status {code}: {why[:300]}"


def wait_for(process, seconds):
    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return process.poll()
