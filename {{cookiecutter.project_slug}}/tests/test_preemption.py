"""Preemption and restarts: signals to torchrun and launch.sh, killed workers, slow checkpoints
under a signal, timed-out runs. Each compares with an uninterrupted run, bit for bit.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import (
    ARGS,
    PROJECT,
    TINY,
    TWO,
    assert_same_metrics,
    assert_same_parameters,
    checkpoint,
    descendants,
    kill_tree,
    run_training,
    saved_step,
    training_command,
    training_env,
    wait_for,
)

from ddp_utils.distributed import process_group

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none


@pytest.fixture
def start_training():
    """Start a 2-process run in the background, its steps slowed until a stop signal (on the
    first attempt only): a signal or kill after a checkpoint lands mid-run, however busy the
    machine. In float64, as the `reference` runs it is compared with. Killed at the end of the
    test."""
    processes = []

    def start(output_dir, *args, torchrun_args=()):
        log = open(output_dir.parent / f"{output_dir.name}.log", "w")
        command = training_command(output_dir, *args, nproc=2, probe="float64,slow_until_stopped",
                                   torchrun_args=torchrun_args)  # fmt: skip
        # A session of its own, so cleanup reaches torchrun's workers too.
        process = subprocess.Popen(
            command, cwd=PROJECT, env=training_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        kill_tree(process.pid)  # torchrun's workers run in sessions of their own: by PID
        process.wait()


def log_of(output_dir):
    return (output_dir.parent / f"{output_dir.name}.log").read_text()


@pytest.mark.quick
def test_sigterm_to_torchrun_saves_mid_epoch_and_resume_is_exact(reference, tmp_path, start_training):
    """SIGTERM (schedulers, Kubernetes) reaches every worker through torchrun; they agree on
    it at the next step, save and exit within seconds; the same command resumes exactly.

    torchrun signals each worker's whole process group, DataLoader workers included (as
    slurmstepd and a pod's stop do): they must keep loading until the checkpoint is saved.
    The reference loads in the training process: the run with workers must equal it. (A
    resume without workers is test_resilience.py's.)"""
    output_dir = tmp_path / "run"
    loading = ["--num_workers", "2"]
    process = start_training(output_dir, *ARGS, *TWO, *loading)
    wait_for(checkpoint(output_dir, 20), process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) != 0
    log = log_of(output_dir)
    assert "stopped by SIGTERM at step" in log and "killed by signal" not in log, log
    step, epoch, batches_done = saved_step(output_dir)
    assert step > 20 and epoch == 1 and batches_done == step - 16  # past the last epoch boundary
    run_training(output_dir, *ARGS, *TWO, *loading, nproc=2, probe="float64")  # the same command again
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_sigusr1_through_the_launch_script_checkpoints_and_exits(tmp_path):
    """SLURM's --signal=USR1: scripts/launch.sh has torchrun forward it to the workers."""
    log = open(tmp_path / "launch.log", "w")
    command = ["scripts/launch.sh", *TINY, *ARGS, *TWO, "--epochs", "100", "--output_dir", str(tmp_path / "run")]
    env = training_env({"NPROC_PER_NODE": "1", "NNODES": "1", "MASTER_ADDR": ""})  # one worker is enough
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(checkpoint(tmp_path / "run", 8), process)
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=30) == 128 + signal.SIGUSR1  # stopped on a signal, checkpoint saved
    finally:
        kill_tree(process.pid)
        process.wait()
    output = (tmp_path / "launch.log").read_text()
    assert "stopped by SIGUSR1 at step" in output, output
    step, _, _ = saved_step(tmp_path / "run")
    assert 8 <= step < 1600


def test_sigterm_to_one_node_stops_every_node_with_the_preemption_status(reference, tmp_path):
    """A pod evicted, one node of two drained: SIGTERM reaches one node's launch.sh (and, through
    torchrun, its DataLoader workers). Every rank agrees to stop and saves; both nodes exit 143,
    the status a scheduler tells a preemption by (k8s/jobset.yaml), not torchrun's 1; the run
    resumes exactly on one node."""
    port = free_port()
    # Its steps slowed (slow_loss), in float64 as the reference ran (tests/sitecustomize.py).
    common = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "RDZV_ENDPOINT": "", "MAX_RESTARTS": "0", "PYTHONPATH": "tests",
              "DDP_PROBE": "float64,slow_loss"}  # fmt: skip
    output_dir, loading = tmp_path / "run", ["--num_workers", "2"]
    command = ["scripts/launch.sh", *TINY, *ARGS, *TWO, *loading, "--output_dir", str(output_dir)]
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = []
    try:
        for rank, log in enumerate(logs):
            env = training_env({**common, "NODE_RANK": str(rank)})
            nodes.append(subprocess.Popen(command, cwd=PROJECT, env=env, stdout=open(log, "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        wait_for(checkpoint(output_dir, 8), nodes[0])
        nodes[1].send_signal(signal.SIGTERM)
        codes = [node.wait(timeout=60) for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node.pid)
            node.wait()
    output = "".join(log.read_text() for log in logs)
    assert codes == [128 + signal.SIGTERM] * 2, output
    assert "stopped by SIGTERM at step" in output and "killed by signal" not in output, output
    run_training(output_dir, *ARGS, *TWO, *loading, nproc=2, probe="float64")
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_killed_worker_is_restarted_by_torchrun_and_resumes_exactly(reference, tmp_path, start_training):
    output_dir = tmp_path / "run"
    process = start_training(output_dir, *ARGS, *TWO, torchrun_args=["--max-restarts=2"])
    wait_for(checkpoint(output_dir, 20), process)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    subprocess.run(["kill", "-KILL", workers[-1]], check=True)
    assert process.wait(timeout=180) == 0, log_of(output_dir)  # two workers start again: slow on a busy machine
    assert "resumed from" in log_of(output_dir)
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def test_a_rank_killed_at_a_checkpoint_stops_its_partner_in_seconds_and_the_restart_resumes_exactly(
    reference, tmp_path
):
    """Rank 0 is SIGKILLed while it writes a checkpoint and rank 1 waits for it at the
    checkpoint's barrier (the store's wait): rank 1 sees rank 0's heartbeat stop and exits by
    itself within seconds, with one line naming the rank (not torchrun's SIGKILL 30 s after
    its SIGTERM, which a wait in the store does not hear); torchrun restarts both and the run
    resumes exactly. bench/rank_loss.py measures the time it takes."""
    output_dir, log = tmp_path / "run", tmp_path / "run.log"
    command = training_command(output_dir, *ARGS, *TWO, nproc=2, probe="float64,slow_second_save",
                               torchrun_args=["--max-restarts=1"])  # fmt: skip
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "second checkpoint write started" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        workers = {worker_rank(pid): pid for pid in descendants(process.pid) if worker_rank(pid) is not None}
        os.kill(workers[0], signal.SIGKILL)
        assert process.wait(timeout=180) == 0, log.read_text()
    finally:
        kill_tree(process.pid)
        process.wait()
    output = log.read_text()
    assert "rank 1: rank 0 stopped answering" in output, output
    assert "resumed from" in output
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)


def worker_rank(pid):
    """The RANK of a torchrun worker (None for another process: torchrun, a loader's worker)."""
    try:
        environ = dict(
            item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
        )
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return int(environ[b"RANK"]) if b"RANK" in environ and b"ddp_probe.py" in cmdline else None


def test_each_restart_and_group_size_gets_its_own_store_keys(monkeypatch):
    """The store handed to init_process_group is a PrefixStore named after
    TORCHELASTIC_RESTART_COUNT and the world size, so a restarted group (or one that a node
    joined) never reads keys an earlier group left in torchrun's store, such as a dead peer's
    address that gloo would wait on forever."""
    captured = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: captured.update(kwargs))
    environment = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "3"}
    environment |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    ctx = process_group.setup_distributed(timeout_seconds=30)
    store = captured["store"]
    assert isinstance(store, dist.PrefixStore) and ctx.store is store
    store.set("key", "value")
    assert store.underlying_store.get("restart_3_world_1/key") == b"value"
    assert process_group.group_prefix({"TORCHELASTIC_RESTART_COUNT": "3"}, 2) != "restart_3_world_1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_checkpoint_slower_than_every_timeout_completes_under_sigusr1(tmp_path):
    """Rank 0 takes 35 s to write the checkpoint (a slow file system) after SLURM's SIGUSR1:
    longer than --timeout_seconds (10) and than torchrun's default 30 s grace. The other rank
    waits for it through the store (--checkpoint_timeout_seconds), and launch.sh gives
    torchrun the stop grace (90 s, less 10) before it kills anyone: the checkpoint is saved."""
    log = open(tmp_path / "launch.log", "w")
    run_dir = tmp_path / "run"
    # One long epoch (small batches: 128 steps of the TINY samples, whatever the data), so no
    # checkpoint is due before the signal; its steps slowed until the signal (slow_until_stopped),
    # so that it lands mid-epoch however late the test sends it.
    command = ["scripts/launch.sh", *TINY, *ARGS, "--batch_size", "4", "--epochs", "1",
               "--checkpoint_every_steps", "0", "--log_every_steps", "4", "--timeout_seconds", "10",
               "--output_dir", str(run_dir)]  # fmt: skip
    env = training_env({"NPROC_PER_NODE": "2", "NNODES": "1", "MASTER_ADDR": "", "PYTHONPATH": "tests",
                        "DDP_PROBE": "slow_checkpoint_write,slow_until_stopped"})  # fmt: skip
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        wait_for(run_dir / "train.log", process)
        while "step 4 loss" not in (run_dir / "train.log").read_text():  # training has started
            assert process.poll() is None, (tmp_path / "launch.log").read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=120) != 0
    finally:
        kill_tree(process.pid)
        process.wait()
    output = (tmp_path / "launch.log").read_text()
    assert "workers get 80 s to stop" in output, output
    assert "PROBE slow checkpoint write started" in output and "stopped by SIGUSR1 at step" in output, output
    assert "timed out" not in output and "SIGKILL" not in output, output
    step, epoch, _ = saved_step(run_dir)
    assert step > 0 and epoch == 0


def test_a_timed_out_run_leaves_no_process_behind(tmp_path):
    """A run past its timeout is ended with all its workers (which torchrun starts in sessions
    of their own, out of reach of its process group)."""
    output_dir = tmp_path / "endless"
    with pytest.raises(subprocess.TimeoutExpired):
        run_training(output_dir, *ARGS, "--epochs", "1000", nproc=2, probe="slow", timeout=15)
    deadline = time.monotonic() + 10  # a killed process on a busy machine takes a moment to go
    while running := [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(output_dir) in read_cmdline(p)]:
        assert time.monotonic() < deadline, running
        time.sleep(0.1)


def read_cmdline(path):
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
