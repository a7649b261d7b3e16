"""The model. Replace `build_model` to train your own; train.py only calls it."""

from torch import nn


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
    return MLP(cfg.input_dim, cfg.hidden_dim, cfg.num_classes)
