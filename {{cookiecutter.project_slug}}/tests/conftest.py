"""Shared helpers: run train.py for real, as one process or under torchrun with gloo on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

# Small and fast: every test trains for real, so keep the task tiny.
TINY = ["--train_samples", "1024", "--val_samples", "256", "--hidden_dim", "32", "--batch_size", "32"]
TINY += ["--epochs", "2", "--lr", "0.01", "--log_every_steps", "0"]


def training_command(output_dir, *args, nproc=1, probe=None, torchrun_args=()):
    """train.py with `nproc` processes (torchrun when nproc > 1), on the TINY task.

    With `probe`, run it through tests/ddp_probe.py with that fault or instrument installed.
    """
    script = ["tests/ddp_probe.py", probe] if probe else ["train.py"]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    return [*launcher, *script, *TINY, "--output_dir", str(output_dir), *map(str, args)]


def training_env(env=None):
    # scripts/launch.sh runs `torchrun`: take it from this interpreter's environment even when
    # that environment is not activated (`.venv/bin/python -m pytest`).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, **(env or {})}


def run_training(output_dir, *args, nproc=1, probe=None, timeout=180, env=None, check=True, torchrun_args=()):
    """Run training to the end; returns the CompletedProcess (raises if it failed and `check`)."""
    command = training_command(output_dir, *args, nproc=nproc, probe=probe, torchrun_args=torchrun_args)
    env = training_env(env)
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def probe_output(result):
    """The PROBE lines printed by rank 0, as dicts."""
    lines = [line.removeprefix("PROBE ") for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return [json.loads(line) for line in lines]


def read_metrics(output_dir):
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def pytest_configure(config):
    config.addinivalue_line("markers", "fixed_amp: sets --amp itself, so the project's default amp does not matter")


def load_final_model(output_dir):
    state = torch.load(Path(output_dir) / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return state["model"]


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory):
    """One 2-process gloo run shared by the tests that only inspect its outputs."""
    output_dir = tmp_path_factory.mktemp("two_process_run")
    result = run_training(output_dir, "--epochs", "3", "--log_every_steps", "4", nproc=2)
    return output_dir, result
