"""Gradient compression for ddp's all-reduce (--comm_hook): fewer bytes over slow links.

The one list of hooks (`COMM_HOOKS`, config.py's choices) and PowerSGD's settings, read by the
strategy that registers them and by the preflight's prediction of what a step sends.
"""

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from ..core.precision import AMP_DTYPES

COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
POWERSGD_RANK = 1  # PowerSGD's matrix_approximation_rank: each matrix travels as two rank-1 factors
POWERSGD_START_ITER = 10  # plain all-reduces for the first 10 steps, then compressed (torch waits 1000)
POWERSGD_MIN_COMPRESSION_RATE = 2  # PowerSGDState's default: smaller matrices go uncompressed


def register_comm_hook(model, name):
    """Compress gradients before DDP's all-reduce: fewer bytes over slow inter-node links."""
    if name in ("bf16", "fp16"):
        model.register_comm_hook(None, compressed_allreduce_hook(AMP_DTYPES[name]))
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START_ITER,
            min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def compressed_allreduce_hook(dtype):
    """Average each gradient bucket in `dtype` (half the bytes of fp32), then copy it back.

    The same arithmetic as PyTorch's fp16/bf16_compress_hook, which refuses to run on gloo.
    """

    def hook(process_group, bucket):
        group = process_group or dist.group.WORLD
        compressed = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
        reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(future):
            return bucket.buffer().copy_(future.value()[0])

        return reduced.then(decompress)

    return hook
