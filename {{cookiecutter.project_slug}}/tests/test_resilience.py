"""Nothing lost: atomic checkpoints, exact resume, preemption, elastic restarts, bad files.

Every test runs real processes and compares against an uninterrupted run, bit for bit.
"""

import os
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import PROJECT, TINY, load_final_model, read_metrics, run_training, training_command, training_env

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

# 1024 samples, global batch 64: 16 optimizer steps per epoch, 48 in all; a checkpoint every
# 4 steps, all kept, so tests can resume from any of them.
ARGS = ["--amp", "none", "--epochs", "3", "--checkpoint_every_steps", "4", "--keep_checkpoints", "100"]
TWO = ["--batch_size", "32"]  # with 2 processes
ONE = ["--batch_size", "64"]  # with 1 process: the same global batch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs: 2 processes, and 1 process with the same global batch."""
    two = tmp_path_factory.mktemp("reference_two")
    run_training(two, *ARGS, *TWO, nproc=2)
    one = tmp_path_factory.mktemp("reference_one")
    run_training(one, *ARGS, *ONE)
    return SimpleNamespace(two=two, one=one)


def checkpoint(output_dir, step):
    return output_dir / "checkpoints" / f"step_{step:09d}.pt"


def start_from(source_checkpoint, output_dir):
    """An output folder whose newest checkpoint is `source_checkpoint`, as if the run had stopped there."""
    (output_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(source_checkpoint, output_dir / "checkpoints" / "last.pt")
    return output_dir


def assert_same_parameters(output_dir, reference_dir):
    ours, theirs = load_final_model(output_dir), load_final_model(reference_dir)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"


TIMINGS = {"samples_per_s", "data_wait_s", "compute_s", "cpu_s", "peak_memory_mb", "mfu"}  # differ run to run


def assert_same_metrics(output_dir, reference_dir):
    """The metrics lines present in `output_dir` equal the reference's lines for those epochs."""
    ours = read_metrics(output_dir)
    theirs = {m["epoch"]: m for m in read_metrics(reference_dir)}
    assert ours, "no metrics written"
    for line in ours:
        expected = theirs[line["epoch"]]
        assert {k: v for k, v in line.items() if k not in TIMINGS} == {
            k: v for k, v in expected.items() if k not in TIMINGS
        }


def saved_step(output_dir):
    state = torch.load(output_dir / "checkpoints" / "last.pt", weights_only=True)
    return state["step"], state["epoch"], state["batches_done"]


def test_checkpoint_holds_everything_to_continue(reference):
    state = torch.load(checkpoint(reference.two, 20), map_location="cpu", weights_only=True)
    assert (state["step"], state["epoch"], state["batches_done"]) == (20, 1, 4)
    assert {"model", "optimizer", "scaler", "config", "ranks", "world_size"} <= state.keys()
    assert len(state["ranks"]) == 2 and {"rng", "loss_totals"} <= state["ranks"][1].keys()
    assert {"torch", "python", "numpy"} <= state["ranks"][0]["rng"].keys()
    assert state["config"]["checkpoint_every_steps"] == 4
    names = sorted(p.name for p in (reference.two / "checkpoints").iterdir())
    assert names == ["last.pt"] + [f"step_{step:09d}.pt" for step in range(4, 49, 4)]  # no temporary files left


def test_resume_at_an_epoch_boundary_is_bit_identical(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 16), tmp_path)
    run_training(output_dir, *ARGS, *TWO, nproc=2)
    assert_same_parameters(output_dir, reference.two)
    assert [m["epoch"] for m in read_metrics(output_dir)] == [2, 3]
    assert_same_metrics(output_dir, reference.two)


def test_resume_mid_epoch_is_bit_identical(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 20), tmp_path)
    result = run_training(output_dir, *ARGS, *TWO, nproc=2)
    assert "resumed from" in result.stdout and "epoch 2, step 20" in result.stdout
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)  # epoch 2's train_loss includes steps 17-20


def wait_for(path, process, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"training ended (rc {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.fixture
def start_training():
    """Start a slowed-down 2-process run in the background; killed at the end of the test."""
    processes = []

    def start(output_dir, *args, torchrun_args=()):
        log = open(output_dir.parent / f"{output_dir.name}.log", "w")
        command = training_command(output_dir, *args, nproc=2, probe="slow", torchrun_args=torchrun_args)
        # A session of its own, so cleanup reaches torchrun's workers too.
        process = subprocess.Popen(
            command, cwd=PROJECT, env=training_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def log_of(output_dir):
    return (output_dir.parent / f"{output_dir.name}.log").read_text()


def test_sigterm_to_torchrun_saves_mid_epoch_and_resume_is_exact(reference, tmp_path, start_training):
    """SIGTERM (schedulers, Kubernetes) reaches every worker through torchrun; they agree on
    it at the next step, save and exit within seconds; the same command resumes exactly."""
    output_dir = tmp_path / "run"
    process = start_training(output_dir, *ARGS, *TWO)
    wait_for(checkpoint(output_dir, 20), process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) != 0
    assert "stopped by SIGTERM at step" in log_of(output_dir)
    step, epoch, batches_done = saved_step(output_dir)
    assert step > 20 and epoch == 1 and batches_done == step - 16  # past the last epoch boundary
    run_training(output_dir, *ARGS, *TWO, nproc=2)  # the same command again
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_sigusr1_through_the_launch_script_checkpoints_and_exits(tmp_path):
    """SLURM's --signal=USR1: scripts/launch.sh has torchrun forward it to the workers."""
    log = open(tmp_path / "launch.log", "w")
    command = ["scripts/launch.sh", *TINY, *ARGS, *TWO, "--epochs", "100", "--output_dir", str(tmp_path / "run")]
    env = training_env({"NPROC_PER_NODE": "2", "NNODES": "1", "MASTER_ADDR": ""})
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(checkpoint(tmp_path / "run", 8), process)
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=30) != 0
    finally:
        process.kill()
    output = (tmp_path / "launch.log").read_text()
    assert "stopped by SIGUSR1 at step" in output, output
    step, _, _ = saved_step(tmp_path / "run")
    assert 8 <= step < 1600


def test_killed_worker_is_restarted_by_torchrun_and_resumes_exactly(reference, tmp_path, start_training):
    output_dir = tmp_path / "run"
    process = start_training(output_dir, *ARGS, *TWO, torchrun_args=["--max-restarts=2"])
    wait_for(checkpoint(output_dir, 20), process)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    subprocess.run(["kill", "-KILL", workers[-1]], check=True)
    assert process.wait(timeout=60) == 0, log_of(output_dir)
    assert "resumed from" in log_of(output_dir)
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_truncated_last_checkpoint_falls_back_to_the_newest_valid_one(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 40), tmp_path)
    shutil.copy(checkpoint(reference.two, 36), checkpoint(output_dir, 36))
    last = output_dir / "checkpoints" / "last.pt"
    last.write_bytes(checkpoint(reference.two, 44).read_bytes()[:50_000])  # a copy cut short
    result = run_training(output_dir, *ARGS, *TWO, nproc=2)
    assert result.stdout.count(f"checkpoint {last} is unreadable") == 1, result.stdout
    assert "resumed from" in result.stdout and "step 36" in result.stdout
    assert_same_parameters(output_dir, reference.two)


def test_no_readable_checkpoint_stops_with_one_message_and_keeps_the_files(tmp_path):
    last = tmp_path / "checkpoints" / "last.pt"
    last.parent.mkdir()
    last.write_bytes(b"not a checkpoint")
    result = run_training(tmp_path, "--amp", "none", nproc=2, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("no readable checkpoint among") == 1 and str(last) in output
    assert 'train.py", line' not in output
    assert last.read_bytes() == b"not a checkpoint"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_crash_while_writing_keeps_the_previous_checkpoint(reference, tmp_path):
    result = run_training(tmp_path, *ARGS, *ONE, probe="crash_in_third_save", check=False)
    assert result.returncode == -signal.SIGKILL
    assert saved_step(tmp_path) == (8, 0, 8)  # the complete checkpoint before the crash
    assert not checkpoint(tmp_path, 12).exists()
    run_training(tmp_path, *ARGS, *ONE)
    assert_same_parameters(tmp_path, reference.one)
    assert not list((tmp_path / "checkpoints").glob(".*"))  # the crash's temporary file is gone


@pytest.mark.parametrize("saved_by, resumed_by", [("two", "one"), ("one", "two")])
def test_another_world_size_continues_from_an_epoch_boundary(reference, tmp_path, saved_by, resumed_by):
    source = checkpoint(getattr(reference, saved_by), 16)
    batch, nproc = (ONE, 1) if resumed_by == "one" else (TWO, 2)
    run_training(tmp_path, *ARGS, *batch, "--resume", source, nproc=nproc)
    ours, theirs = load_final_model(tmp_path), load_final_model(getattr(reference, resumed_by))
    for key in theirs:  # the same data order; equal up to float summation order
        assert ((ours[key] - theirs[key]).norm() / theirs[key].norm()).item() < 1e-4, key


def test_checkpoint_of_another_model_shape_is_refused(reference, tmp_path):
    result = run_training(tmp_path, *ARGS, "--hidden_dim", "48", "--resume", checkpoint(reference.two, 16), check=False)
    assert result.returncode == 1
    assert "--hidden_dim is 48, the checkpoint's is 32" in result.stdout


def test_resume_none_refuses_to_overwrite_a_run(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 16), tmp_path)
    result = run_training(output_dir, *ARGS, "--resume", "none", check=False)
    assert result.returncode == 1
    assert "--resume none, but" in result.stdout and "--resume auto" in result.stdout
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["last.pt"]


def test_mid_epoch_checkpoint_converts_to_another_world_size_or_refuses(reference, tmp_path):
    """Step 20 of the 2-process run is 256 samples into epoch 2: 4 batches of 64 for one process
    (the same data order), but no whole number of global batches of 48."""
    source = checkpoint(reference.two, 20)
    run_training(tmp_path / "one", *ARGS, *ONE, "--resume", source)
    ours, theirs = load_final_model(tmp_path / "one"), load_final_model(reference.one)
    for key in theirs:
        assert ((ours[key] - theirs[key]).norm() / theirs[key].norm()).item() < 1e-4, key
    result = run_training(tmp_path / "odd", *ARGS, "--batch_size", "48", "--resume", source, check=False)
    assert result.returncode == 1
    assert "stopped 256 samples into epoch 2, not a whole number of global batches of 48" in result.stdout
