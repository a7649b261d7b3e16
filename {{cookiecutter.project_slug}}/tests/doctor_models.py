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


def world_size():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class ScalesWithWorldSize(nn.Linear):
    """A forward that depends, by a factor of 1 + `by` per extra process, on the world size."""

    by = 0.0

    def forward(self, x):
        return super().forward(x) * (1 + self.by * (world_size() - 1))


def scales_by_a_millionth(cfg):
    model = ScalesWithWorldSize(8, 4)
    model.by = 1e-6
    return model


class CastsInside(nn.Module):
    """Part of its forward in float32 whatever dtype it is given, as Mamba's A_log.float() is:
    a parameter cast, its gradient summed over the batch in float32. `by`: ScalesWithWorldSize's."""

    by = 0.0

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.decay = nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x):
        gate = torch.sigmoid(self.layer(x).float() * self.decay.float().exp())  # float32 here
        return self.layer(x) * gate.to(x.dtype) * (1 + self.by * (world_size() - 1))


def casts_inside(cfg):
    return CastsInside()


def casts_inside_and_scales(cfg):
    model = CastsInside()
    model.by = 1e-4  # a hundred times float32's tolerance (TOLERANCES): a fault, found however subtle
    return model


class KeyBias(nn.Module):
    """Attention within each sample (2 tokens of 4): the key's bias shifts every score of a
    query alike, so softmax ignores it and its gradient is zero in exact arithmetic, as a ViT's is."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 4)

    def forward(self, x):
        tokens = x.view(len(x), 2, 4)
        scores = torch.softmax(self.query(tokens) @ self.key(tokens).transpose(1, 2), dim=-1)
        return self.head((scores @ tokens).flatten(1))


def key_bias(cfg):
    return KeyBias()


class Experts(nn.Module):
    """A mixture of 2 experts, each sample routed to one by the sign of its first feature: an
    expert that gets no sample in a batch gets no gradient from it."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 4), nn.Linear(8, 4)])

    def forward(self, x):
        routed = (x[:, 0] > 0).long()
        out = torch.zeros(len(x), 4, dtype=x.dtype)
        for index, expert in enumerate(self.experts):
            chosen = routed == index
            if chosen.any():  # as Hugging Face's per-expert loops skip an expert without tokens
                out[chosen] = expert(x[chosen])
        return out
