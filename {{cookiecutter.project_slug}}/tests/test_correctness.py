"""Properties that make DDP training correct, each checked by running real processes.

docs/guarantees.md (the correctness guarantees) names these tests.
"""

import functools
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import task_settings
import torch
from conftest import (
    TINY_CONFIG,
    compared_metrics,
    gap,
    load_final_model,
    probe_output,
    read_metrics,
    relative_difference,
    run_tolerance,
    run_training,
)
from torch.utils.data import Dataset, get_worker_info

from config import Config
from ddp_utils.data.loaders import build_loaders, start_epoch
from task import TASK

pytestmark = pytest.mark.fixed_amp  # exact comparisons need --amp none; set per run below

EXACT = ["--amp", "none", "--epochs", "2", "--val_samples", "255"]  # odd: ranks evaluate 128 and 127
EQUIVALENCE_STEPS = 32  # 2 epochs of 16 optimizer steps


@pytest.fixture(scope="module")
def equivalent_runs(tmp_path_factory):
    """The same global batch (64) three ways, each recording its gradient norms; the last also
    counts gradient all-reduces. In float64 (tests/ddp_probe.py float64), so that what is
    compared is the distributed arithmetic, not float32 rounding amplified by the optimizer."""
    runs = {}
    for name, args, nproc, probe in [
        ("1x64", ["--batch_size", "64"], 1, "record_grad_norms"),
        ("2x32", ["--batch_size", "32"], 2, "record_grad_norms"),
        ("2x16_accum2", ["--batch_size", "16", "--grad_accum_steps", "2"], 2, "record_grad_norms,count_allreduce"),
    ]:
        output_dir = tmp_path_factory.mktemp(name)
        result = run_training(output_dir, *EXACT, *args, nproc=nproc, probe=f"float64,{probe}")
        probed = {key: value for line in probe_output(result) for key, value in line.items()}
        runs[name] = SimpleNamespace(output_dir=output_dir, probed=probed, model=load_final_model(output_dir))
    return runs


@functools.cache
def compared_runs():
    """2 x 32 always; 2 x 16 with accumulation only where micro-batches leave results alone
    (not with BatchNorm, whose statistics are those of each micro-batch)."""
    with torch.device("meta"):
        model = TASK.build_model(TINY_CONFIG.resolved())  # its sizes read from the data
    batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return ("2x32",) if batchnorm else ("2x32", "2x16_accum2")


@pytest.mark.quick
def test_world_size_and_accumulation_give_the_same_parameters(equivalent_runs):
    reference = equivalent_runs["1x64"].model
    for name in compared_runs():
        model = equivalent_runs[name].model
        worst, key = max((relative_difference(model[key], reference[key]), key) for key in reference)
        tolerance = run_tolerance()
        assert worst < tolerance, (
            f"{name}: {key} differs by {worst:.2e} (relative), {worst / tolerance:.3g}x {tolerance:g}"
        )


@pytest.mark.quick
def test_world_size_and_accumulation_give_the_same_gradients(equivalent_runs):
    """Adam barely notices gradients off by a constant factor (a loss not divided by the
    accumulation steps), so equal parameters alone would not show it; clipping thresholds and
    SGD would. Every step's gradient norm must match the single-process run's (float64: up to
    the order of the sums)."""
    reference = equivalent_runs["1x64"].probed["grad_norms"]
    assert len(reference) == EQUIVALENCE_STEPS  # every step's
    for name in compared_runs():
        norms = equivalent_runs[name].probed["grad_norms"]
        assert norms == pytest.approx(reference, rel=run_tolerance()), gap(norms, reference, name, run_tolerance())


@pytest.mark.quick
def test_world_size_and_accumulation_give_the_same_metrics(equivalent_runs):
    reference = read_metrics(equivalent_runs["1x64"].output_dir)
    for name in compared_runs():
        for ours, theirs in zip(read_metrics(equivalent_runs[name].output_dir), reference, strict=True):
            assert ours["step"] == theirs["step"]
            assert ours["val_samples"] == theirs["val_samples"] == 255
            ours, theirs = compared_metrics(ours), compared_metrics(theirs)  # the task's metrics, whatever they are
            assert ours.keys() == theirs.keys() and "val_loss" in ours
            for key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=run_tolerance()), gap(
                    ours[key], theirs[key], f"{name}: {key}", run_tolerance()
                )


@pytest.mark.quick
def test_accumulation_all_reduces_once_per_optimizer_step(equivalent_runs):
    run = equivalent_runs["2x16_accum2"]
    steps = read_metrics(run.output_dir)[-1]["step"]
    assert steps == EQUIVALENCE_STEPS
    assert run.probed["allreduce_calls"] == steps  # one bucket for this small model, once per step


@pytest.mark.quick
def test_evaluation_counts_every_sample_once(equivalent_runs, tmp_path):
    """The same parameters evaluated by 2 processes give the single-process numbers, with an
    odd val_samples that splits 128/127 (averaging per-rank means would be off)."""
    single = equivalent_runs["1x64"]
    expected = read_metrics(single.output_dir)[-1]
    checkpoint = single.output_dir / "checkpoints" / "last.pt"
    result = run_training(tmp_path, *EXACT, "--resume", checkpoint, nproc=2, probe="float64,eval_only")
    (metrics,) = probe_output(result)
    assert metrics["val_samples"] == 255 and "val_loss" in metrics
    for key, value in metrics.items():  # the task's metrics, whatever they are: sums in another order
        assert value == pytest.approx(expected[key], rel=run_tolerance()), gap(
            value, expected[key], key, run_tolerance()
        )


@pytest.fixture(scope="module")
def seeded_runs(tmp_path_factory):
    """2-process runs with DataLoader workers and the task's data randomness (noise, random
    windows or crops): twice the same, once another seed."""
    args = ["--amp", "none", "--epochs", "2", "--num_workers", "2", *task_settings.AUGMENT]
    runs = {}
    for name, seed in [("a", 0), ("a_again", 0), ("b", 1)]:
        output_dir = tmp_path_factory.mktemp(name)
        run_training(output_dir, *args, "--seed", seed, nproc=2)
        runs[name] = load_final_model(output_dir)
    return runs


def test_identical_runs_are_bit_identical(seeded_runs):
    a, again = seeded_runs["a"], seeded_runs["a_again"]
    assert all(torch.equal(a[key], again[key]) for key in a)


def test_another_seed_gives_other_parameters(seeded_runs):
    a, b = seeded_runs["a"], seeded_runs["b"]
    assert not any(torch.equal(a[key], b[key]) for key in a)


class RandomDraws(Dataset):
    """Each item is what the global random generators give in the process that loads it."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        worker = get_worker_info()
        return torch.tensor([torch.rand(1).item(), np.random.rand(), random.random(), worker.id if worker else -1])


def draws(rank, epoch, seed=0):
    cfg = Config(seed=seed, num_workers=2, batch_size=4)
    ctx = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    loader, _ = build_loaders(cfg, ctx, RandomDraws(), RandomDraws())
    start_epoch(loader, epoch, rank, seed)
    return torch.cat(list(loader))


def test_data_pipeline_randomness_differs_across_workers_ranks_epochs():
    rank0 = draws(rank=0, epoch=0)
    worker0, worker1 = rank0[rank0[:, 3] == 0, :3], rank0[rank0[:, 3] == 1, :3]
    assert len(worker0) == len(worker1) > 0
    for generator in range(3):  # torch, numpy, random: each differs across workers
        assert not set(worker0[:, generator].tolist()) & set(worker1[:, generator].tolist())
    assert torch.equal(rank0, draws(rank=0, epoch=0))  # reproducible
    for other in (draws(rank=1, epoch=0), draws(rank=0, epoch=1)):
        assert not set(rank0[:, :3].flatten().tolist()) & set(other[:, :3].flatten().tolist())


def test_non_finite_loss_on_one_rank_stops_every_rank(tmp_path):
    result = run_training(tmp_path, "--amp", "none", "--timeout_seconds", "30", nproc=2, probe="nan_on_rank1",
                          check=False, timeout=90)  # fmt: skip
    assert result.returncode != 0
    assert result.stdout.count("loss or gradients are not finite at optimizer step 3") == 1, (
        result.stdout + result.stderr
    )
    assert "Traceback" not in result.stdout


def test_fp16_skips_an_overflowing_step_and_goes_on(tmp_path):
    run_training(tmp_path, "--amp", "fp16", probe="overflow_once")
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["scaler"]["scale"] == 2.0**15  # halved once from 2**16 by the skipped step
    assert all(torch.isfinite(value).all() for value in state["model"].values())
    assert all(math.isfinite(m["train_loss"]) for m in read_metrics(tmp_path))  # the skip is no NaN loss


FP16_FAILURES = {
    # A NaN loss is not an overflow the scaler can fix: every rank stops, under fp16 too.
    "nan_loss": (2, "nan_on_rank1", [], "loss or gradients are not finite at optimizer step 3"),
    # Diverged: the loss becomes inf/NaN (the issue's --lr 10000 without clipping).
    "diverged": (1, None, ["--lr", "10000", "--max_grad_norm", "0"], "loss or gradients are not finite at optimizer"),
    # Every step overflows: the scale halves each step from 2**16 and passes the floor (1) on
    # the 17th skip, step 19.
    "scale_floor": (1, "overflow_from_step3", [], "fp16 loss scale fell below --min_loss_scale 1 at optimizer step 19"),
    "skips_in_a_row": (
        1,
        "overflow_from_step3",
        ["--max_skipped_steps", "5"],
        "5 optimizer steps in a row skipped for fp16 overflow, up to step 7 (--max_skipped_steps)",
    ),
}


@pytest.mark.parametrize("case", FP16_FAILURES)
def test_fp16_failure_stops_every_rank_with_one_line_naming_the_knobs(tmp_path, case):
    nproc, probe, args, message = FP16_FAILURES[case]
    result = run_training(tmp_path, "--amp", "fp16", "--timeout_seconds", "30", *args, nproc=nproc, probe=probe,
                          check=False, timeout=90)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert result.stdout.count(message) == 1, output
    (line,) = [line for line in result.stdout.splitlines() if message in line]
    assert "--lr" in line and "--amp bf16" in line  # the knobs to change
    assert (
        'train.py", line' not in output and 'trainer.py", line' not in output
    )  # no rank's traceback (torchrun's own summary may follow)


def test_stop_request_on_one_rank_stops_every_rank_together(tmp_path):
    result = run_training(tmp_path, "--amp", "none", "--timeout_seconds", "30", nproc=2, probe="stop_on_rank1",
                          check=False, timeout=90)  # fmt: skip
    assert result.returncode != 0
    # Seen by rank 1 in step 3, agreed in step 3's all-reduce, read (without waiting for it)
    # after step 4: every rank stops at step 4.
    assert "stopped by SIGTERM at step 4" in result.stdout
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert (state["step"], state["epoch"], state["batches_done"]) == (4, 0, 4)


def test_clipping_sees_the_true_gradient_norm(tmp_path):
    """Clipping acts on the true gradients: fp16 unscales first, so the norm it clips is that of
    the fp32 run, not 65536 times larger, and after clipping the norm is max_grad_norm. The
    first step's norms differ by autocast's fp16 (a 10-bit mantissa: ~1e-3 per operation, a
    few in a row): 5%, far from a scale of 65536 left in."""
    reference = run_training(tmp_path / "none", "--amp", "none", "--max_grad_norm", "0.01", probe="record_clip")
    (expected,) = probe_output(reference)
    scaled = run_training(tmp_path / "fp16", "--amp", "fp16", "--max_grad_norm", "0.01", probe="record_clip")
    (clip,) = probe_output(scaled)
    assert clip["before"] == pytest.approx(expected["before"], rel=0.05)
    for run in (clip, expected):
        assert run["after"] == pytest.approx(0.01, rel=1e-3)


def test_unused_parameters_error_names_the_fix(tmp_path):
    result = run_training(tmp_path, "--amp", "none", nproc=2, probe="unused_param", check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("set --find_unused_parameters true") == 1, output
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in output
    run_training(tmp_path / "fixed", "--amp", "none", "--find_unused_parameters", "true", probe="unused_param")
