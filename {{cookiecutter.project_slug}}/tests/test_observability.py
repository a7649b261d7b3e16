"""What a run shows: progress bar (rank 0, TTY only), MFU, and the speed knobs (trackers and
the profiler: test_experiments.py)."""

import dataclasses
import fcntl
import functools
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from types import SimpleNamespace

import pytest
import task_settings
import torch
from conftest import PROJECT, TINY, TINY_CONFIG, probe_output, read_metrics, run_training, training_env

from config import Config
from ddp_utils.doctor.run import build
from ddp_utils.observe import flops, metrics
from ddp_utils.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointable_blocks
from task import TASK

pytestmark = pytest.mark.fixed_amp


def test_mfu_arithmetic():
    # 1 GFLOP per sample at 400k samples/s on 8 GPUs of 100 TFLOPS: 50 TFLOPS each, 50%.
    assert flops.mfu(1e9, 400_000, 8, 100.0) == pytest.approx(0.5)
    assert flops.mfu(1e9, 400_000, 8, 0.0) is None  # unknown device: no estimate


@pytest.mark.parametrize(
    "device, amp, tf32, peak",
    [
        ("NVIDIA H200", "bf16", True, 989.0),
        ("NVIDIA H200 NVL", "bf16", True, 835.0),
        ("NVIDIA H100 80GB HBM3", "bf16", True, 989.0),  # SXM
        ("NVIDIA H100 PCIe", "bf16", True, 756.0),
        ("NVIDIA H100 NVL", "fp16", True, 835.0),
        ("NVIDIA A100-SXM4-40GB", "bf16", True, 312.0),
        ("NVIDIA A100 80GB PCIe", "bf16", True, 312.0),
        ("NVIDIA L40S", "bf16", True, 362.0),
        ("NVIDIA A100-SXM4-80GB", "none", True, 156.0),  # TF32 tensor cores
        ("NVIDIA A100-SXM4-80GB", "none", False, 19.5),  # plain FP32
        ("NVIDIA H100 80GB HBM3", "none", False, 67.0),
        ("Tesla V100-SXM2-16GB", "none", True, 15.7),  # no TF32 on Volta
        ("NVIDIA L40", "bf16", True, 181.0),  # not the L4 its name begins with
        ("NVIDIA L4", "bf16", True, 121.0),
        ("NVIDIA B200", "bf16", True, 2250.0),
        ("NVIDIA A10G", "bf16", True, 0.0),  # no data sheet: --peak_tflops
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", True, 0.0),  # a slice of a GPU: not the whole one's peak
        ("Mystery GPU", "bf16", True, 0.0),
    ],
)
def test_peak_tflops_match_the_exact_device_and_precision(device, amp, tf32, peak):
    assert flops.peak_tflops(device, amp, tf32) == peak


def test_peak_tflops_override():
    assert flops.peak_tflops("NVIDIA H200", "bf16", True, override=500.0) == 500.0


def test_peak_memory_is_reset_for_each_epoch():
    cpu = torch.device("cpu")
    metrics.reset_peak_memory(cpu)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    high = metrics.peak_memory_mb(cpu)
    del block
    metrics.reset_peak_memory(cpu)
    assert metrics.peak_memory_mb(cpu) < high - 32


def run_on_a_terminal(tmp_path, *args, nproc=2):
    """Run training with stdout and stderr on a pseudo-terminal, as a person at a shell would."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    command += [*TINY, "--amp", "none", "--output_dir", str(tmp_path), *args]
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=terminal, stderr=terminal)
    os.close(terminal)
    output = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 120)
        assert ready, "no output for 120 s"
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: every process has exited
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=60) == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


def test_progress_bar_on_a_terminal_only_from_rank_zero(tmp_path):
    output = run_on_a_terminal(tmp_path / "tty")
    assert "epoch 1/2: 100%" in output and "16/16" in output
    assert "epoch 2/2: 100%" in output
    assert "[rank 1]" not in output


# --activation_checkpointing full where the task's model has blocks: it recomputes, the same arithmetic.
CHECKPOINTED = ["--activation_checkpointing", "full"] if checkpointable_blocks(TASK.build_model(TINY_CONFIG)) else []


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """One process, one epoch, --amp none, --peak_tflops 100 (and CHECKPOINTED), its output to a
    pipe, not a terminal: (its folder, the CompletedProcess), for the tests that only read what it
    wrote. (Counting the FLOPs for MFU builds the model on the meta device: no random draw, the
    same training.)"""
    output_dir = tmp_path_factory.mktemp("piped")
    flags = ["--amp", "none", "--epochs", "1", "--peak_tflops", "100", *CHECKPOINTED]
    return output_dir, run_training(output_dir, *flags, nproc=1)


def test_no_progress_bar_when_disabled_or_not_a_terminal(tmp_path, piped_run):
    assert "100%" not in run_on_a_terminal(tmp_path / "off", "--progress_bar", "false", nproc=1)
    _, piped = piped_run  # the bar's default, on
    assert "100%" not in piped.stdout + piped.stderr


def test_progress_bar_is_never_shown_by_other_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = Config(progress_bar=True)
    assert metrics.Reporter(SimpleNamespace(is_main=True), cfg, tmp_path).progress
    assert not metrics.Reporter(SimpleNamespace(is_main=False), cfg, tmp_path).progress


def test_metrics_split_time_and_report_memory(tmp_path):
    """(With DataLoader workers: closing the run ends them all, in order, at once.)"""
    result = run_training(tmp_path, "--num_workers", "2", probe="children_after_close")
    (closed,) = probe_output(result)
    assert closed["children"] == 0 and closed["close_s"] < 4, closed  # not 5 s per worker waited in vain
    for line in read_metrics(tmp_path):
        assert line["data_wait_s"] >= 0 and line["compute_s"] > 0 and line["peak_memory_mb"] > 50
        assert "mfu" not in line  # CPU: no peak to compare with


@pytest.mark.parametrize("hook, bytes_per_value", [("bf16", 2), ("fp16", 2)])
def test_compression_hooks_halve_the_all_reduced_bytes(tmp_path, hook, bytes_per_value):
    # One process still all-reduces (a group of one) through the hook: the bytes are the same.
    result = run_training(tmp_path, "--comm_hook", hook, "--epochs", "1", probe="count_compressed_bytes")
    (counted,) = probe_output(result)
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    parameters = sum(p.numel() for p in TASK.build_model(Config(**state["config"])).parameters())  # tied ones once
    steps = read_metrics(tmp_path)[-1]["step"]
    assert counted["compressed_bytes"] == steps * parameters * bytes_per_value  # fp32 would be 4 per value
    assert read_metrics(tmp_path)[-1]["val_loss"] < task_settings.CHANCE_LOSS


def test_powersgd_hook_trains(tmp_path):
    run_training(tmp_path, "--comm_hook", "powersgd", "--amp", "bf16")
    assert read_metrics(tmp_path)[-1]["val_loss"] < task_settings.CHANCE_LOSS


def test_compile_trains_and_matches_eager_closely(tmp_path, piped_run):
    """--compile: under ddp the whole wrapped model, under fsdp each shard unit in place (FSDP2's
    hooks between them stay eager); both train as the eager run does (float32, another order
    of the sums under fsdp: close, not equal)."""
    eager = read_metrics(piped_run[0])[0]
    flags = ["--amp", "none", "--epochs", "1", "--compile", "true"]
    ddp = run_training(tmp_path / "ddp", *flags, timeout=300, probe="record_compiled_units")
    half = ["--batch_size", str(TINY_CONFIG.batch_size // 2)]  # 2 processes: the same global batch
    fsdp = run_training(tmp_path / "fsdp", *flags, *half, "--strategy", "fsdp", nproc=2, timeout=300,
                        probe="record_compiled_units")  # fmt: skip
    ((ddp_compiled,), (fsdp_compiled,)) = probe_output(ddp), probe_output(fsdp)
    assert ddp_compiled["compiled_whole"] and not fsdp_compiled["compiled_whole"]
    assert fsdp_compiled["compiled_units"] == fsdp_compiled["units"], fsdp_compiled
    for name in ("ddp", "fsdp"):
        assert read_metrics(tmp_path / name)[0]["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-3), name


def test_mfu_is_reported_where_the_peak_is_known(piped_run):
    """--peak_tflops: the FLOPs of a sample counted on the meta device, MFU in every metrics line.
    With --activation_checkpointing, MFU stays on the model's FLOPs and HFU beside it counts the
    hardware's: the recomputed forwards too, as counted on the model checkpointed."""
    lines = read_metrics(piped_run[0])
    assert lines and all(0 < line["mfu"] < 1 for line in lines)
    if not CHECKPOINTED:
        return
    cfg = dataclasses.replace(TINY_CONFIG, amp="none").resolved()
    _, samples, _ = build(TASK, cfg)  # a few samples: each sample's FLOPs are the same
    model = flops.flops_per_sample(cfg, TASK, samples)
    checkpointed = functools.partial(apply_activation_checkpointing, mode="full")
    hardware = flops.flops_per_sample(cfg, TASK, samples, checkpointed)
    assert hardware > model
    assert all(line["hfu"] == pytest.approx(line["mfu"] * hardware / model, rel=1e-9) for line in lines), lines


def test_nothing_outside_the_step_stops_a_run(tmp_path):
    """A model whose forward cannot run on the meta device (it reads a value, as Hugging Face's
    mask code does) gets no MFU, and a profile that cannot be written (its folder is a file) is
    lost: each says so in one warning, and the run trains to the end as it would have."""
    (tmp_path / "profile").write_text("not a folder")
    flags = ["--peak_tflops", "100", "--profile_steps", "2:3", "--epochs", "1"]
    result = run_training(tmp_path, *flags, nproc=2, probe="item_in_forward")
    printed = result.stdout + result.stderr
    assert printed.count("MFU not reported: the model's forward cannot run on the meta device") == 1, printed
    assert printed.count("--profile_steps: the profile of steps 2-3 could not be written") == 1, printed
    assert "Traceback" not in printed, printed
    assert all("mfu" not in line for line in read_metrics(tmp_path))
    assert read_metrics(tmp_path)[-1]["val_loss"] < task_settings.CHANCE_LOSS
