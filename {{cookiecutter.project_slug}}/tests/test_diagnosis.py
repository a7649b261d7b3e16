"""Hangs are diagnosed, not endured; the preflight tells before a long job what will go wrong."""

import json
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import PROJECT, TINY, run_training, training_env

from config import Config
from ddp_utils.distributed import device, faults, process_group
from ddp_utils.errors import PreflightError
from ddp_utils.parallel.comm_hooks import COMM_HOOKS
from ddp_utils.preflight import comm_model, local_checks, measure


@pytest.mark.fixed_amp
def test_stalled_rank_fails_the_job_within_the_timeout_with_stacks(tmp_path):
    started = time.monotonic()
    result = run_training(tmp_path, "--amp", "none", "--timeout_seconds", "5", nproc=2, probe="stall_rank1",
                          check=False, timeout=200)  # fmt: skip
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # The 5 s timeout and start-up (up to a minute on a busy machine), not the 300 s stall.
    assert elapsed < 120, f"took {elapsed:.0f} s"
    # Which ranks were waiting where: both name the phase, and each prints its Python stack.
    assert "rank 0: no progress for 5 s in training, optimizer step 3" in output
    assert "rank 1: no progress for 5 s in training, optimizer step 3" in output
    assert 'ddp_probe.py", line' in output and "in run_batch" in output  # rank 1's stack: the stall
    # Rank 0's stack: waiting in DDP's collective, the gradient all-reduce (in backward) or, for
    # a model with buffers (a Llama's rotary frequencies), their broadcast before forward.
    assert "in backward" in output or "in _sync_buffers" in output
    assert "a collective timed out after --timeout_seconds 5" in output
    # The stalled rank leaves on torchrun's stop at once, not killed after its grace period.
    assert "rank 1: stop requested while stalled in training, optimizer step 3; exiting" in output
    assert "Unable to shutdown process" not in output and "forcefully exiting" not in output


@pytest.mark.fixed_amp
def test_an_unexpected_error_is_logged_first_and_nothing_waits_for_the_dead_rank(tmp_path):
    """Rank 1 raises in its 3rd micro-step. Its traceback is logged once, before anything else
    it does, and the job ends at once: rank 0 finds its peer gone in the gradient all-reduce
    and ends too, without waiting for the collective timeout (300 s here)."""
    started = time.monotonic()
    result = run_training(tmp_path, "--amp", "none", "--timeout_seconds", "300", nproc=2, probe="fail_on_rank1",
                          check=False, timeout=200)  # fmt: skip
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 120, (elapsed, output)  # start-up, on a busy machine too
    assert output.count("[rank 1] ERROR rank 1 failed") == 1, output
    assert output.count("ValueError: injected failure on rank 1") == 1, output  # no second traceback
    assert output.index("[rank 1] ERROR rank 1 failed") < output.index("ValueError: injected failure")


def test_collective_timeouts_are_told_apart_from_other_timeouts():
    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
    )
    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")
    assert faults.is_collective_timeout(gloo) and faults.is_collective_timeout(nccl)
    for other in (
        RuntimeError("DataLoader timed out after 30 seconds"),
        TimeoutError("timed out"),
        OSError("[Errno 110] Connection timed out: '/mnt/nfs/data'"),
    ):
        assert not faults.is_collective_timeout(other)


def test_each_process_trains_on_the_gpu_it_was_given(monkeypatch):
    """LOCAL_RANK picks among the GPUs a process sees; when a scheduler shows each process only
    its own GPU (srun --gpus-per-task=1), that one is cuda:0 whatever LOCAL_RANK is."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device.local_gpu(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device.local_gpu(3) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="LOCAL_RANK 3 but this process sees 2 GPUs"):
        device.local_gpu(3)


# --- a GPU job never trains on the CPU by accident --------------------------------------------


@pytest.mark.parametrize(
    "env, args, asked",
    [
        ({"CUDA_VISIBLE_DEVICES": "0"}, [], "CUDA_VISIBLE_DEVICES=0"),
        ({"SLURM_JOB_GPUS": "0,1"}, [], "SLURM_JOB_GPUS=0,1"),
        ({}, ["--device", "cuda"], "--device cuda"),
    ],
)
def test_gpus_asked_for_but_cuda_unusable_stops_with_one_line(tmp_path, env, args, asked):
    """A node whose driver is broken, or whose torch cannot use it, must not 'train' at CPU speed:
    GPUs given by the scheduler (or --device cuda) and no usable CUDA stop the run before anything
    is written, with one line saying why. (This machine has no GPU, which plays the broken node.)"""
    if torch.cuda.is_available():
        pytest.skip("CUDA works here")
    unset = {name: "" for name in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS")}
    result = run_training(tmp_path / "run", *args, env={**unset, **env}, check=False, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"GPUs were asked for ({asked}) but CUDA is unavailable" in line
    assert device.cuda_unavailable_reason() in line and "--device cpu" in line
    assert not (tmp_path / "run").exists()


def test_device_cpu_trains_on_the_cpu_where_gpus_are_visible(tmp_path):
    result = run_training(tmp_path, "--device", "cpu", "--max_steps", "2", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert "training 2 steps" in result.stdout


def test_what_counts_as_gpus_asked_for():
    for empty in ("", "-1", "NoDevFiles", "void", "none"):  # values that hide every GPU
        assert device.gpus_requested({"CUDA_VISIBLE_DEVICES": empty, "NVIDIA_VISIBLE_DEVICES": empty}) is None
    assert device.gpus_requested({"SLURM_GPUS_ON_NODE": "0"}) is None
    assert device.gpus_requested({"SLURM_GPUS_ON_NODE": "4"}) == "SLURM_GPUS_ON_NODE=4"
    assert device.gpus_requested({"CUDA_VISIBLE_DEVICES": "GPU-5d1c"}) == "CUDA_VISIBLE_DEVICES=GPU-5d1c"
    assert device.gpus_requested({}) is None
    # NVIDIA's CUDA images set NVIDIA_VISIBLE_DEVICES=all themselves: GPUs only where the driver is.
    assert device.gpus_requested({"NVIDIA_VISIBLE_DEVICES": "all"}, nvidia_devices=False) is None
    assert device.gpus_requested({"NVIDIA_VISIBLE_DEVICES": "all"}, nvidia_devices=True) == "NVIDIA_VISIBLE_DEVICES=all"


def test_why_cuda_is_unusable_names_the_versions(monkeypatch):
    """A wheel built for a newer CUDA than the driver supports, and a node without a driver."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(device, "cuda_driver_version", lambda: (12, 2))
    reason = device.cuda_unavailable_reason()
    assert "built for CUDA 12.8, but the NVIDIA driver supports CUDA up to 12.2" in reason
    monkeypatch.setattr(device, "cuda_driver_version", lambda: None)
    assert "no NVIDIA driver is loaded" in device.cuda_unavailable_reason()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in device.cuda_unavailable_reason()


def test_preflight_reports_gpus_asked_for_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA works here")
    command = [sys.executable, "preflight.py", *TINY]
    result = subprocess.run(command, cwd=PROJECT, env=training_env({"CUDA_VISIBLE_DEVICES": "0,1"}),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1
    assert "PROBLEM: GPUs were asked for (CUDA_VISIBLE_DEVICES=0,1) but CUDA is unavailable" in result.stdout


def test_tf32_leaves_both_of_torchs_apis_readable_and_agreeing():
    """--tf32 on or off: torch's legacy flags (allow_tf32, the float32 matmul precision) and,
    where torch has it, its fp32_precision API read the same setting, and neither raises (torch
    refuses to read the legacy flags once only the new API was set; Inductor, cuDNN and other
    libraries read them). A fresh process: the settings are global."""
    check = (
        "import torch\nfrom ddp_utils.distributed.device import set_tf32\n"
        "for enabled in (True, False, True):\n"
        "    set_tf32(enabled)\n"
        "    assert torch.backends.cuda.matmul.allow_tf32 is enabled\n"
        "    assert torch.backends.cudnn.allow_tf32 is enabled\n"
        "    assert torch.get_float32_matmul_precision() == ('high' if enabled else 'highest')\n"
        "    assert (torch.backends.cuda.matmul.fp32_precision == 'tf32') is enabled\n"
        "    assert (torch.backends.cudnn.conv.fp32_precision == 'tf32') is enabled\n"
    )
    result = subprocess.run([sys.executable, "-c", check], cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_slurm_job_ports_stay_below_the_ephemeral_range():
    ports = [process_group.job_port(job_id) for job_id in range(0, 200_000, 7)]
    assert min(ports) >= 20000 and max(ports) < 32768
    sbatch = PROJECT / "scripts" / "slurm.sbatch"
    if sbatch.exists():  # slurm=yes: the same formula
        assert "$((20000 + SLURM_JOB_ID % 12768))" in sbatch.read_text()


def test_preflight_on_one_machine_prints_table_and_verdict():
    """Under --strategy fsdp (ddp's preflight runs across two hosts: cluster/test_multinode.py).
    FSDP communicates all through a step (DDP's no_sync leaves nothing out of it), so each
    process times the compute alone first, in a process group of its own. The checkpoint, which
    every rank writes a share of, is timed against the stop notice that scripts/launch.sh gives
    the processes (its STOP_GRACE_SECONDS, exported): a small one fits the default."""
    env = training_env({"NPROC_PER_NODE": "2", "NNODES": "1", "MASTER_ADDR": "", "PREFLIGHT_MAX_MB": "4"})
    result = subprocess.run(["scripts/launch.sh", "--preflight", *TINY, "--strategy", "fsdp"], cwd=PROJECT, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce of 2 ranks correct" in result.stdout
    sizes = re.findall(r"^ *(\d+) MiB +[\d.]+ ms ", result.stdout, re.MULTILINE)  # the bandwidth table's rows
    assert sizes == ["1", "4"], result.stdout  # 1 and 4 MiB, none past PREFLIGHT_MAX_MB
    for rank in (0, 1):
        assert f"preflight [rank {rank}] compute alone (fsdp over this process only): " in result.stdout
    verdict = result.stdout.split("verdict: ", 1)[1]
    assert verdict.startswith("per optimizer step: compute") and "FSDP's all-gathers and reduce-scatters" in verdict
    assert "a checkpoint, written and fsynced in " in result.stdout
    assert "(by every rank its shards, at most" in result.stdout
    grace = re.search(r"STOP_GRACE_SECONDS:-(\d+)", (PROJECT / "scripts" / "launch.sh").read_text())[1]
    assert "a preemption's checkpoint fits the stop notice: " in result.stdout
    assert f"s of {int(grace) - 10} s (STOP_GRACE_SECONDS {grace})" in result.stdout


def test_preflight_says_when_a_checkpoint_does_not_fit_the_stop_notice(tmp_path):
    """With no time between the stop signal and the kill, the preflight warns, with the save
    time it measured, the knob that raises the notice and what a preemption falls back to; a
    warning: the job can run. --json holds the numbers."""
    command = [sys.executable, "preflight.py", *TINY, "--output_dir", str(tmp_path), "--json"]
    result = subprocess.run(command, cwd=PROJECT, env=training_env({"STOP_GRACE_SECONDS": "0"}), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads(result.stdout)["checkpoint"]
    assert saved["bytes"] > 0 and saved["bytes_per_rank"] == saved["bytes"]  # one process: rank 0 writes it all
    assert 0 < saved["write_seconds"] <= saved["preemption_save_seconds"]
    assert saved["workers_stop_seconds"] == 0 and saved["fits_notice"] is False
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("WARNING: a preemption's checkpoint")]
    assert "the workers get 0 s after a stop signal (STOP_GRACE_SECONDS 0)" in warning
    assert "resumes from its last periodic checkpoint" in warning and "--checkpoint_every_steps" in warning
    assert "Raise the notice to " in warning and "STOP_GRACE_SECONDS=" in warning and "--signal=B:USR1@" in warning
    assert not list(tmp_path.iterdir())  # the test file is gone, and nothing else was written


def test_the_preflight_names_processes_that_share_one_gpu():
    """NCCL refuses two processes on one GPU only as the group forms ("Duplicate GPU
    detected"): a node where every process sees the same single GPU (CUDA_VISIBLE_DEVICES=0 for
    all) gets that far. The processes of a node first tell each other their GPU through the
    store (here two threads, one store), and the preflight names the fix."""
    store, seen = torch.distributed.HashStore(), {}

    def report(local_rank, gpu):
        seen[local_rank] = local_checks.node_gpus(store, "node0", local_rank, 2, gpu, timedelta(seconds=30))

    threads = [threading.Thread(target=report, args=(rank, "NVIDIA H100 GPU-a1")) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {0: {0: "NVIDIA H100 GPU-a1", 1: "NVIDIA H100 GPU-a1"}, 1: seen[0]}
    problem = local_checks.shared_gpu_problem(seen[0], "node0")
    assert problem.startswith("local ranks 0 and 1 on node0 would all train on one GPU, NVIDIA H100 GPU-a1")
    fix = "Set NPROC_PER_NODE=1, or show each process its own GPU (CUDA_VISIBLE_DEVICES)"
    assert problem.endswith(f"(NCCL stops with 'Duplicate GPU detected'): 2 processes for 1 GPU(s). {fix}")
    # A wrapper that gives each process its own CUDA_VISIBLE_DEVICES, and one of them twice.
    problem = local_checks.shared_gpu_problem({0: "GPU-a", 1: "GPU-b", 2: "GPU-a"}, "node1")
    assert problem.startswith("local ranks 0 and 2 on node1 would all train on one GPU, GPU-a ") and "=2," in problem
    assert local_checks.shared_gpu_problem({0: "GPU-a", 1: "GPU-b"}, "node0") is None


def test_bus_bandwidth_follows_nccl_tests():
    assert comm_model.bus_bandwidth(10.0, 2) == 10.0
    assert comm_model.bus_bandwidth(10.0, 8) == pytest.approx(17.5)


def test_allreduce_estimate_scales_the_nearest_measured_size():
    rows = [(1, 0.001, 1.0, 1.0), (16, 0.010, 1.6, 1.6), (256, 0.100, 2.6, 2.6)]
    assert comm_model.allreduce_seconds(16 * 2**20, rows) == pytest.approx(0.010)
    assert comm_model.allreduce_seconds(32 * 2**20, rows) == pytest.approx(0.020)
    assert comm_model.allreduce_seconds(2**19, rows) == pytest.approx(0.0005)


def test_verdict_warns_when_communication_dominates():
    assert "compute-bound" in comm_model.verdict(0.001, 0.010, 16)
    assert "SLOWER than one" in comm_model.verdict(0.030, 0.010, 16)
    assert "single process" in comm_model.verdict(0.0, 0.010, 1)


def test_what_crosses_the_inter_node_link_under_each_strategy():
    """Per optimizer step and node, 2 nodes x 4 processes, 1M parameters (4 MB of fp32
    gradients): ddp all-reduces the gradients over all 8 (2 x 7/8 x 4 MB); fsdp all-gathers the
    bf16 parameters twice (forward and backward) and reduce-scatters fp32 gradients over all 8
    (7/8 x 8 MB); hsdp keeps those inside the node and all-reduces gradient shards between the
    2 replicas (2 x 1/2 x 4 MB)."""
    parameters = [torch.zeros(1000, 1000)]
    sent = {hook: comm_model.gradient_bytes(parameters, hook) for hook in COMM_HOOKS}
    cfg = Config(amp="bf16")
    crossing = comm_model.internode_bytes(parameters, cfg, world_size=8, nodes=2, sent=sent)
    assert crossing == {"ddp": 7_000_000, "fsdp": 7_000_000, "hsdp": 4_000_000}
    on_gloo = comm_model.internode_bytes(parameters, cfg, world_size=8, nodes=2, sent=sent, backend="gloo")
    assert on_gloo["fsdp"] == 10_500_000  # its reduce-scatter is a whole all-reduce
    one_node = comm_model.internode_bytes(parameters, cfg, world_size=8, nodes=1, sent=sent)
    assert one_node == {"ddp": 0, "fsdp": 0, "hsdp": 0}


# NCCL's own NCCL_DEBUG=INFO lines (NVIDIA/nccl issues #226, #302; siderolabs/docs #566).
NCCL_IB = """\
nccl-test:179:179 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>
nccl-test:179:179 [0] NCCL INFO Using network IB
nccl-test:179:179 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
"""
NCCL_SOCKET = """\
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/IB : No device found.
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.21<0>
ip-172-31-12-21:45361:45361 [0] NCCL INFO Using network Socket
"""


def test_the_preflight_names_the_network_nccl_chose():
    ib = measure.nccl_transport(NCCL_IB)
    assert ib.startswith("IB (NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB") and ib.endswith("GPUDirect RDMA")
    socket = measure.nccl_transport(NCCL_SOCKET)
    assert socket.startswith("Socket (NET/Socket : Using [0]ens3:172.31.12.21<0>): TCP, no InfiniBand")
    assert measure.nccl_transport("NCCL INFO cudaDriverVersion 12080\n") is None


def test_place_checks_catch_inconsistent_launch_variables(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(PreflightError, match="outside WORLD_SIZE"):
        local_checks.check_place({"RANK": 4, "LOCAL_RANK": 0, "WORLD_SIZE": 4})
    with pytest.raises(PreflightError, match="no multiple"):
        local_checks.check_place({"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 3})
    assert "rank 1 of 4" in local_checks.check_place({"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 4})
