"""The model, its loss and its validation metrics: this file and dataset.py are the task.

What train.py uses from here (contract.py reads it; only `build_model` is required):
- `build_model(cfg) -> nn.Module`: built as written, with torch seeded by --seed, under ddp
  and fsdp alike (your initialisation is kept). Its forward gets the batch's inputs: the first
  element of a tuple or list, a dict's "inputs", or the batch itself.
- `loss_fn(output, batch)`: the mean training loss. Default: cross-entropy against batch[1].
- `evaluation_sums(output, batch) -> {name: sum}`: summed over every validation batch and
  rank, then `evaluation_metrics(sums) -> {metric: value}`, which must include "val_loss".
  Default: the loss and accuracy of a classifier.
- `SHAPE_FIELDS`: config fields a checkpoint to resume must match. Default: none.
- On the model, optionally: `shard_units()`, the blocks --strategy fsdp shards one by one
  (default: the children of its largest nn.ModuleList/nn.Sequential); `init_weights(name,
  module)`, an initialisation module by module, which lets a model too big for one process
  start on the meta device.
- `tokens_per_sample(cfg)`: predictions per sample, for a tokens/s figure. Default: 1.

This task is a classifier, or a regression (MSE, R^2) with --dataset regression: the dtype of
the targets tells which.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from contract import classification_metrics, classification_sums
from knobs import ConfigError, knob

# A checkpoint to resume must match these (the other fields may change between runs).
SHAPE_FIELDS = ("input_dim", "hidden_dim", "num_classes", "dataset")


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
    outputs = 1 if cfg.dataset == "regression" else cfg.num_classes
    return MLP(cfg.input_dim, cfg.hidden_dim, outputs)


def loss_fn(output, batch):
    """Cross-entropy against class indices; the mean squared error against real-valued targets."""
    _, targets = batch
    if targets.is_floating_point():
        return F.mse_loss(output.squeeze(-1), targets)
    return F.cross_entropy(output, targets)


def evaluation_sums(output, batch):
    _, targets = batch
    if not targets.is_floating_point():
        return classification_sums(output, batch)
    output = output.squeeze(-1).to(targets.dtype)
    return {
        "squared_error": (output - targets).square().sum(),
        "targets": targets.sum(),
        "squared_targets": targets.square().sum(),
        "samples": len(targets),
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
