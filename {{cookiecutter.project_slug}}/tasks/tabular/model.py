"""The model. Replace `build_model` (and ModelConfig's knobs) to train your own; train.py only
calls it."""

from dataclasses import dataclass

from torch import nn

from knobs import ConfigError, knob

# A checkpoint to resume must match these (the other fields may change between runs).
SHAPE_FIELDS = ("input_dim", "hidden_dim", "num_classes")


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

    def shard_units(self):
        """What --strategy fsdp shards one by one: each linear layer."""
        return [layer for layer in self.layers if isinstance(layer, nn.Linear)]


def build_model(cfg):
    return MLP(cfg.input_dim, cfg.hidden_dim, cfg.num_classes)
