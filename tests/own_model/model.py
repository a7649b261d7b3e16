"""A model the generated project's tests have never seen (tests/test_own_model.py drops it into
a tabular project's model.py): each feature becomes a token, an nn.TransformerEncoder reads
them, and the head starts at zero, its own initialisation, which training must start from.

nn.TransformerEncoder's attention (nn.MultiheadAttention) has no public reset_parameters, and
the model says nothing about sharding: the template must find its blocks by itself.
"""

from dataclasses import dataclass

import torch
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob
from torch import nn

SHAPE_FIELDS = ("input_dim", "d_model", "num_classes")


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = knob(16, "width of each feature's token")
    layers: int = knob(2, "encoder layers")

    def check_model(self):
        if self.d_model < 2 or self.d_model % 2:
            raise ConfigError("d_model", "must be an even number of at least 2")


class FeatureTransformer(nn.Module):
    def __init__(self, input_dim, d_model, layers, num_classes):
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        self.position = nn.Parameter(torch.randn(input_dim, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, features):
        tokens = self.embed(features.unsqueeze(-1)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))


def build_model(cfg):
    return FeatureTransformer(cfg.input_dim, cfg.d_model, cfg.layers, cfg.num_classes)
