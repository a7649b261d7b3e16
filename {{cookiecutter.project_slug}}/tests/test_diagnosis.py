"""Hangs are diagnosed, not endured; the preflight tells before a long job what will go wrong."""

import subprocess
import time

import pytest
from conftest import PROJECT, run_training, training_env

import preflight


def test_stalled_rank_fails_the_job_within_the_timeout_with_stacks(tmp_path):
    started = time.monotonic()
    result = run_training(tmp_path, "--amp", "none", "--timeout_seconds", "5", nproc=2, probe="stall_rank1",
                          check=False, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert elapsed < 45, f"took {elapsed:.0f} s"  # 5 s timeout + start-up, not the 60 s stall
    # Which ranks were waiting where: both name the phase, and each prints its Python stack.
    assert "rank 0: no progress for 5 s in training, optimizer step 3" in output
    assert "rank 1: no progress for 5 s in training, optimizer step 3" in output
    assert 'ddp_probe.py", line' in output and "in run_batch" in output  # rank 1's stack: the stall
    assert "in backward" in output  # rank 0's stack: waiting for the gradient all-reduce
    assert "a collective timed out after --timeout_seconds 5" in output


def test_preflight_on_one_machine_prints_table_and_verdict():
    env = training_env({"NPROC_PER_NODE": "2", "NNODES": "1", "MASTER_ADDR": "", "PREFLIGHT_MAX_MB": "4"})
    result = subprocess.run(["scripts/launch.sh", "--preflight", "--hidden_dim", "64"], cwd=PROJECT, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce of 2 ranks correct" in result.stdout
    assert "    1 MB" in result.stdout and "    4 MB" in result.stdout and "16 MB" not in result.stdout
    assert "verdict: per optimizer step: compute" in result.stdout


def test_bus_bandwidth_follows_nccl_tests():
    assert preflight.bus_bandwidth(10.0, 2) == 10.0
    assert preflight.bus_bandwidth(10.0, 8) == pytest.approx(17.5)


def test_allreduce_estimate_scales_the_nearest_measured_size():
    rows = [(1, 0.001, 1.0, 1.0), (16, 0.010, 1.6, 1.6), (256, 0.100, 2.6, 2.6)]
    assert preflight.allreduce_seconds(16 * 2**20, rows) == pytest.approx(0.010)
    assert preflight.allreduce_seconds(32 * 2**20, rows) == pytest.approx(0.020)
    assert preflight.allreduce_seconds(2**19, rows) == pytest.approx(0.0005)


def test_verdict_warns_when_communication_dominates():
    assert "compute-bound" in preflight.verdict(0.001, 0.010, 16)
    assert "SLOWER than one" in preflight.verdict(0.030, 0.010, 16)
    assert "single process" in preflight.verdict(0.0, 0.010, 1)


def test_place_checks_catch_inconsistent_launch_variables(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(preflight.PreflightError, match="outside WORLD_SIZE"):
        preflight.check_place({"RANK": 4, "LOCAL_RANK": 0, "WORLD_SIZE": 4})
    with pytest.raises(preflight.PreflightError, match="no multiple"):
        preflight.check_place({"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 3})
    assert "rank 1 of 4" in preflight.check_place({"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 4})
