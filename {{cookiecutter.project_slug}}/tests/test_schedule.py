import math

import pytest

from config import Config
from train import lr_at


def test_warmup_is_linear_up_to_lr():
    cfg = Config(lr=1.0, warmup_steps=4, lr_schedule="constant")
    assert [lr_at(step, cfg, total_steps=100) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_lr_to_min_ratio():
    cfg = Config(lr=2.0, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1)
    total = 11
    assert lr_at(0, cfg, total) == pytest.approx(2.0)
    assert lr_at(5, cfg, total) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert lr_at(10, cfg, total) == pytest.approx(0.2)
    values = [lr_at(step, cfg, total) for step in range(total)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_starts_after_warmup():
    cfg = Config(lr=1.0, warmup_steps=10, min_lr_ratio=0.0)
    assert lr_at(9, cfg, 110) == 1.0
    assert lr_at(10, cfg, 110) == 1.0
    assert lr_at(60, cfg, 110) == pytest.approx(0.5 * (1 + math.cos(math.pi * 50 / 99)))
    assert lr_at(109, cfg, 110) == pytest.approx(0.0)


def test_constant_schedule_is_off():
    cfg = Config(lr=0.3, lr_schedule="constant")
    assert {lr_at(step, cfg, 50) for step in range(50)} == {0.3}
