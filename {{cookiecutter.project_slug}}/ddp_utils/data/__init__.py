"""The data side of training: which rank reads which samples, the loaders, seeding.

    loaders.py  which rank sees which samples, loaders, seeding, the batch a dataset gathers

The names a task's dataset.py imports are here: `from ddp_utils.data import mix_seed, Batch`.
"""

from .loaders import Batch, mix_seed

__all__ = ["Batch", "mix_seed"]
