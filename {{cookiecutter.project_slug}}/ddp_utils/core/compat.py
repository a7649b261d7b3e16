"""Bridges between the torch releases the project supports (pyproject.toml's range): each
names the release that needs it, so it can go when that release leaves the range."""

import inspect

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def buffer_sync_setting(ddp_settings):
    """The name of DDP's setting for sending rank 0's buffers before each forward, among the
    names of its settings: torch 2.13 renamed it (the old name warns there); older releases
    know only broadcast_buffers."""
    return "forward_sync_buffers" if "forward_sync_buffers" in ddp_settings else "broadcast_buffers"


BUFFER_SYNC = buffer_sync_setting(inspect.signature(DDP).parameters)


def stager_reusable(stager_class):
    """Whether one DCP stager can stage save after save, into the same buffers. torch 2.11's
    DefaultStager cannot: its stage ends by closing its state-dict stager, which empties the
    cache the next stage reads (KeyError); newer releases keep it."""
    try:
        return "self._state_dict_stager.close()" not in inspect.getsource(stager_class._stage)
    except (OSError, TypeError):  # no source to read: a new stager for each save is safe anyway
        return False


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns there);
# older releases know only all_gather_into_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
