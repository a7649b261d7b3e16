"""Small models and losses with the faults doctor.py is for, in a module of their own: the
doctor's 2 processes import what they run from here (a new process imports it by name)."""

import torch
from torch import nn


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


def loss_per_class_present(output, batch):
    """Divided by a count that differs between the ranks' shares (the classes each holds)."""
    return nn.functional.cross_entropy(output, batch[1], reduction="sum") / batch[1].unique().numel()


class Normed(nn.Module):
    """A batch norm without synchronisation: each process normalises its share alone."""

    def __init__(self):
        super().__init__()
        self.layer, self.norm = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.layer(x))


def normed(cfg):
    return Normed()


def linear(cfg):
    return nn.Linear(8, 4)


class Renormed(nn.Module):
    """nn.Embedding's max_norm: each forward rescales, in place, the rows its batch looks up.
    (And a bool buffer, as a causal mask is: compared exactly, no float arithmetic on it.)"""

    def __init__(self):
        super().__init__()
        self.embedding, self.layer = nn.Embedding(16, 8, max_norm=1.0), nn.Linear(8, 4)
        self.register_buffer("mask", torch.ones(3, 3, dtype=torch.bool).tril())

    def forward(self, x):
        return self.layer(self.embedding(x).mean(1))


def renormed(cfg):
    return Renormed()


class FailsOnRank1(nn.Linear):
    """A forward that raises on rank 1 only: rank 0 then loses its peer in the all-reduce."""

    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            raise ValueError("rank 1's own fault")
        return super().forward(x)


def fails_on_rank1(cfg):
    return FailsOnRank1(8, 4)
