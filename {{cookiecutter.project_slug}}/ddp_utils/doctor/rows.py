"""The doctor's rows (`check`: pass, warn or fail, with why and the fix), and the comparisons
its checks share: batches halved, tensors equal to the bit, parameters gathered whole."""

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..contract import count_samples

ERROR_LIMIT = 200  # characters of an error's first line in a row


def check(name, status, summary, fix=""):
    return {"check": name, "status": status, "summary": summary, "fix": fix}


def to_float64(batch):
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, batch)


def halves(batch):
    """The first two halves of equal size (an odd sample left out): two ranks' shares."""
    size = count_samples(batch) // 2
    return [
        tree_map_only(torch.Tensor, lambda t: t[:size], batch),
        tree_map_only(torch.Tensor, lambda t: t[size : 2 * size], batch),
    ]


def same(a, b):
    """Bit for bit the same (NaN included), for tensors, arrays and what holds them."""
    (leaves, spec), (others, other_spec) = tree_flatten(a), tree_flatten(b)
    return spec == other_spec and all(map(same_leaf, leaves, others))


def same_leaf(x, y):
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        return x == y or (x != x and y != y)  # NaN
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))


def whole(tensor):
    """A parameter as a plain tensor: FSDP's shards gathered (a collective), others detached."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
