"""The learning-rate schedule: a pure function of training progress (samples trained), so a
run resumed with another world size, batch size or accumulation continues the same curve."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """The run's length and warmup in samples (all ranks together): the schedule's inputs."""

    total_samples: int
    warmup_samples: int


def lr_at(samples, cfg, plan, peak=None):
    """Learning rate of the optimizer step that brings training to `samples` samples: linear
    warmup to `peak` (default --lr), then cosine or constant.

    A pure function of samples trained, not of steps: a run resumed with another world size,
    batch size or accumulation continues the same curve and still ends at the floor.
    """
    peak = cfg.lr if peak is None else peak
    if samples < plan.warmup_samples:
        return peak * samples / plan.warmup_samples
    if cfg.lr_schedule == "constant":
        return peak
    progress = min(1.0, (samples - plan.warmup_samples) / max(1, plan.total_samples - plan.warmup_samples))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
