"""Yours: the model, its loss and its validation metrics; task.py hands them to the machinery
(every hook it may hand over: ddp_utils/contract.py's docstring).

This task is a classifier, or a regression (MSE, R^2) when --target_kind resolves to regression
(a numeric --target, or --dataset regression): the dtype of the targets tells the loss which.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ddp_utils.contract import classification_metrics, classification_sums, cross_entropy, targets
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob

# A checkpoint to resume must match these (the other fields may change between runs).
SHAPE_FIELDS = ("input_dim", "hidden_dim", "num_classes", "target_kind")


@dataclass(frozen=True)
class ModelConfig:
    """The model's knobs: fields of Config, each a --flag (input_dim and num_classes come
    with the data, in DataConfig)."""

    hidden_dim: int = knob(256, "width of the two hidden layers")

    def check_model(self):
        if self.hidden_dim < 1:
            raise ConfigError("hidden_dim", "must be at least 1")

    def resolve_model(self):
        return {}


class MLP(nn.Module):
    """input_dim -> hidden_dim -> ReLU -> hidden_dim -> ReLU -> num_classes."""

    def __init__(self, input_dim, hidden_dim, num_classes):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, num_classes),
        )

    def forward(self, inputs):
        return self.layers(inputs)


def build_model(cfg):
    outputs = 1 if cfg.target_kind == "regression" else cfg.num_classes
    return MLP(cfg.input_dim, cfg.hidden_dim, outputs)


def loss_fn(output, batch):
    """Cross-entropy against class indices; the mean squared error against real-valued targets."""
    values = targets(batch)
    if values.is_floating_point():
        return F.mse_loss(output.squeeze(-1), values)
    return cross_entropy(output, batch)


def evaluation_sums(output, batch):
    values = targets(batch)
    if not values.is_floating_point():
        return classification_sums(output, batch)
    output = output.squeeze(-1).to(values.dtype)
    return {
        "squared_error": (output - values).square().sum(),
        "targets": values.sum(),
        "squared_targets": values.square().sum(),
        "samples": len(values),
    }


def evaluation_metrics(sums):
    """Classification: loss and accuracy. Regression: the MSE as val_loss, and R^2 (the share
    of the targets' variance the model explains: 1 is perfect, 0 is predicting the mean)."""
    if "squared_error" not in sums:
        return classification_metrics(sums)
    n = sums["samples"]
    variance = sums["squared_targets"] / n - (sums["targets"] / n) ** 2
    mse = sums["squared_error"] / n
    return {"val_loss": mse, "val_r2": 1 - mse / variance if variance > 0 else 0.0}
