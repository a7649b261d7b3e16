"""The learning-rate schedule: a pure function of samples trained (ddp_utils/optim/lr_schedule.py)."""

import math

import pytest

from config import Config
from ddp_utils.optim.lr_schedule import Plan, lr_at


def test_warmup_is_linear_up_to_lr():
    """4 warmup steps of a global batch of 8: lr/4, lr/2, 3lr/4, lr at the ends of steps 1-4."""
    cfg = Config(lr=1.0, warmup_steps=4, lr_schedule="constant")
    plan = Plan(total_samples=800, warmup_samples=4 * 8)
    assert [lr_at(8 * step, cfg, plan) for step in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_lr_to_min_ratio():
    cfg = Config(lr=2.0, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1)
    plan = Plan(total_samples=1000, warmup_samples=0)
    assert lr_at(0, cfg, plan) == pytest.approx(2.0)
    assert lr_at(500, cfg, plan) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert lr_at(1000, cfg, plan) == pytest.approx(0.2)  # the last step ends at the floor
    values = [lr_at(samples, cfg, plan) for samples in range(0, 1001, 10)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_starts_after_warmup():
    cfg = Config(lr=1.0, warmup_steps=10, min_lr_ratio=0.0)
    plan = Plan(total_samples=1100, warmup_samples=100)
    assert lr_at(99, cfg, plan) == pytest.approx(0.99)
    assert lr_at(100, cfg, plan) == 1.0
    assert lr_at(600, cfg, plan) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(1100, cfg, plan) == pytest.approx(0.0)


def test_constant_schedule_is_off():
    cfg = Config(lr=0.3, lr_schedule="constant")
    plan = Plan(total_samples=5000, warmup_samples=0)
    assert {lr_at(samples, cfg, plan) for samples in range(64, 5001, 64)} == {0.3}


def test_the_curve_is_the_same_whatever_the_global_batch():
    """Half a run at a global batch of 64, the rest at 32 (a node lost): every step's lr is the
    lr of the same sample count in a run at 64 alone, and the run ends at the floor."""
    cfg = Config(lr=0.01, warmup_steps=4, min_lr_ratio=0.1)
    plan = Plan(total_samples=4096, warmup_samples=4 * 64)
    samples, mixed = 0, []
    for global_batch in [64] * 32 + [32] * 64:
        samples += global_batch
        mixed.append((samples, lr_at(samples, cfg, plan)))
    assert samples == 4096 and mixed[-1][1] == pytest.approx(0.001)
    steps_at_64 = {64 * step: lr_at(64 * step, cfg, plan) for step in range(1, 65)}
    for samples, lr in mixed:
        if samples in steps_at_64:
            assert lr == steps_at_64[samples]
