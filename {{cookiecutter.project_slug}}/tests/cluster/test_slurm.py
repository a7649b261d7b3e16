"""SLURM for real: scripts/slurm.sbatch and `srun python train.py` on a cluster of this machine.

tests/cluster/slurm_cluster.py starts munge, slurmctld and two slurmd (no systemd) for the session;
without root or Debian's packages (apt-get install slurmd slurmctld slurm-client munge) these
tests skip. The nodes have no GPUs: jobs are submitted with --gpus-per-node=0 and
NPROC_PER_NODE, which override the script's #SBATCH lines, as a user would on CPU nodes.
Every job trains the same task with two ranks, so the plain batch job is the reference the
others must equal, bit for bit.
"""

import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import task_settings
import torch
from conftest import PROJECT, TINY, load_final_model, read_metrics
from slurm_cluster import FINISHED, slurm_fixture  # noqa: F401 (slurm_fixture: the `slurm` fixture)

from ddp_utils.distributed import process_group

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

# 1024 samples, global batch 2 x 32: 16 steps per epoch, 192 in all, a checkpoint after each
# epoch. A few seconds of training: SIGUSR1 sent at the first checkpoint lands mid-run.
EPOCHS = 12
ARGS = [*TINY, "--amp", "none", "--epochs", str(EPOCHS), "--checkpoint_every_steps", "16"]
SBATCH = PROJECT / "scripts" / "slurm.sbatch"
RESULTS = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "val_samples", "lr")  # no timings
JOB_TIMEOUT = 240  # seconds for any one job; a hang fails the test


def needs_sbatch_script():
    if not SBATCH.exists():
        pytest.skip("scripts/slurm.sbatch was not generated (slurm=no)")


def job_env(slurm, nproc):
    """The submitting shell's environment: this Python's torchrun on PATH, NPROC_PER_NODE set."""
    return slurm.env({"NPROC_PER_NODE": nproc, "OMP_NUM_THREADS": 1}, path_first=[Path(sys.executable).parent])


def sbatch_args(folder, name, *options, train_args=()):
    """sbatch arguments for scripts/slurm.sbatch on the CPU nodes: output in folder/name, log in folder/name.out."""
    script = str(SBATCH.relative_to(PROJECT))
    options = [*options, "--gpus-per-node=0", f"--job-name={name}", f"--output={folder / name}.out"]
    return [*options, script, *ARGS, *train_args, "--output_dir", str(folder / name)]


def run_batch_job(slurm, folder, name, *options, nproc):
    """`sbatch --wait`: returns when the job has ended, with the job's exit code."""
    command = ["sbatch", "--wait", *sbatch_args(folder, name, *options)]
    result = slurm.run(command, env=job_env(slurm, nproc), cwd=PROJECT, timeout=JOB_TIMEOUT, check=False)
    log = folder / f"{name}.out"
    job_id = int(result.stdout.split()[-1]) if "Submitted batch job" in result.stdout else None
    return SimpleNamespace(
        result=result, job_id=job_id, output_dir=folder / name, log=log.read_text() if log.exists() else ""
    )


def assert_succeeded(job, slurm):
    assert job.result.returncode == 0, f"{job.result.stdout}{job.result.stderr}\n{job.log}\n{slurm.logs()}"


def assert_same_parameters(output_dir, reference_dir):
    ours, theirs = load_final_model(output_dir), load_final_model(reference_dir)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the reference job"


def assert_same_metrics(output_dir, reference_dir):
    """The same metrics.jsonl, timings aside."""

    def results(metrics):
        return [{key: line[key] for key in RESULTS} for line in metrics]

    assert results(read_metrics(output_dir)) == results(read_metrics(reference_dir))


@pytest.fixture(scope="module")
def batch_job(slurm, tmp_path_factory):
    """One node, one task running torchrun with 2 processes: the reference for the other jobs."""
    needs_sbatch_script()
    return run_batch_job(slurm, tmp_path_factory.mktemp("slurm"), "batch", "--nodes=1", nproc=2)


def test_batch_script_trains_with_torchrun_on_one_node(slurm, batch_job):
    assert_succeeded(batch_job, slurm)
    port = process_group.job_port(batch_job.job_id)  # below the ephemeral range, as srun-style jobs
    started = re.search(
        rf"slurm.sbatch: job {batch_job.job_id} \(restart 0\) on (\S+), 2 process\(es\) per node", batch_job.log
    )
    assert started and started[1] in slurm.names, batch_job.log
    node = started[1]
    assert f"1 node(s) x 2 process(es), c10d rendezvous at {node}:{port} (id {batch_job.job_id})" in batch_job.log
    # The script's own #SBATCH --signal=B:USR1@90 sets the stop grace: torchrun waits 90 - 10 s.
    assert "workers get 80 s to stop" in batch_job.log
    metrics = read_metrics(batch_job.output_dir)
    assert [m["epoch"] for m in metrics] == list(range(1, EPOCHS + 1))
    assert metrics[-1]["step"] == 16 * EPOCHS and metrics[-1]["val_loss"] < task_settings.CHANCE_LOSS
    state = torch.load(batch_job.output_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert (state["epoch"], state["step"], len(state["ranks"])) == (EPOCHS, 16 * EPOCHS, 2)


def wait_for_file(path, slurm, job_id, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} is {state} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.1)


def wait_through_requeue(slurm, job_id, timeout=JOB_TIMEOUT):
    """Wait until the job has finished for good. A requeued job may start again only about two
    minutes later (Reason=BeginTime); as an administrator would, start it sooner instead."""
    deadline, idle_since, released = time.monotonic() + timeout, None, False
    while (job := slurm.job(job_id))["JobState"] not in FINISHED:
        if not released and job["JobState"] == "PENDING" and job.get("Reason") == "BeginTime" and slurm.nodes_idle():
            # Not at once: slurmd refuses a job credential issued in the same second as the one it
            # revoked when the previous run ended ("Job credential revoked"), and StartTime=now+1
            # would wait for the scheduler's next periodic pass.
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 1.5:
                slurm.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
                released = True
        assert time.monotonic() < deadline, f"job {job_id} did not finish within {timeout} s: {job}"
        time.sleep(0.25)
    return job


def test_sigusr1_checkpoints_requeues_and_the_job_resumes_exactly(slurm, batch_job, tmp_path):
    """What --signal=B:USR1@90 does before the time limit, sent now with scancel. torchrun passes
    SIGUSR1 to each worker's process group: DataLoader workers, whose default action on it is
    to die, must keep loading until the checkpoint is saved (2 of them per rank here; the
    signal path without workers is test_preemption.py's)."""
    assert_succeeded(batch_job, slurm)
    args = sbatch_args(tmp_path, "preempted", "--nodes=1", train_args=["--num_workers", "2"])
    # Its first run's steps slowed until the signal (not the requeued run's): it lands mid-run
    # however long the signal takes through slurmctld, slurmd and torchrun on a busy machine.
    env = {**job_env(slurm, 2), "PYTHONPATH": str(PROJECT / "tests"), "DDP_PROBE": "slow_until_stopped"}
    job_id = slurm.sbatch(args, env=env, cwd=PROJECT)
    output_dir, log = tmp_path / "preempted", tmp_path / "preempted.out"
    wait_for_file(output_dir / "checkpoints" / "last.pt", slurm, job_id)
    slurm.run(["scancel", "--signal=USR1", "--batch", str(job_id)])
    job = wait_through_requeue(slurm, job_id)
    text = log.read_text()
    assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0"), f"{job}\n{text}"
    assert f"SIGUSR1: checkpointing, then requeueing job {job_id}" in text
    assert "stopped by SIGUSR1 at step" in text
    assert f"job {job_id} (restart 1)" in text and "resumed from" in text
    stopped_at = int(text.split("stopped by SIGUSR1 at step ")[1].split(";")[0])
    assert 16 <= stopped_at < 16 * EPOCHS, "the signal did not land mid-run"
    assert_same_parameters(output_dir, batch_job.output_dir)
    assert_same_metrics(output_dir, batch_job.output_dir)


def test_batch_script_spans_two_nodes(slurm, batch_job, tmp_path):
    """Two slurmd, one torchrun per node with one process each, meeting at the first node."""
    assert_succeeded(batch_job, slurm)
    if len(slurm.names) < 2:
        pytest.skip("only one node name resolves on this machine (its host name or localhost)")
    job = run_batch_job(slurm, tmp_path, "two_nodes", "--nodes=2", nproc=1)
    assert_succeeded(job, slurm)
    started = re.search(
        rf"slurm.sbatch: job {job.job_id} \(restart 0\) on (\S+) (\S+), 1 process\(es\) per node", job.log
    )
    assert started and sorted(started.groups()) == sorted(slurm.names), job.log
    assert job.log.count(f"2 node(s) x 1 process(es), c10d rendezvous at {started[1]}:") == 2  # one per node
    assert_same_parameters(job.output_dir, batch_job.output_dir)
    assert_same_metrics(job.output_dir, batch_job.output_dir)


def test_srun_starts_one_rank_per_task(slurm, tmp_path, request):
    """The other SLURM style: no torchrun, `srun --ntasks=2 python train.py`; ranks from SLURM_PROCID."""
    command = ["srun", "--job-name=srun", "--nodes=1", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, "train.py"]
    command += [*ARGS, "--output_dir", str(tmp_path)]
    result = slurm.run(command, env=job_env(slurm, 2), cwd=PROJECT, timeout=JOB_TIMEOUT, check=False)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{slurm.logs()}"
    assert "[rank 0] INFO training" in result.stdout and "[rank 1]" not in result.stdout + result.stderr
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert len(state["ranks"]) == 2
    assert [m["epoch"] for m in read_metrics(tmp_path)] == list(range(1, EPOCHS + 1))
    batch_job = request.getfixturevalue("batch_job") if SBATCH.exists() else None
    if batch_job is not None and batch_job.result.returncode == 0:  # the same ranks and data as under torchrun
        assert_same_parameters(tmp_path, batch_job.output_dir)
        assert_same_metrics(tmp_path, batch_job.output_dir)
