"""The data side of training: which rank reads which samples, the loaders, seeding; and the
datasets of the tasks' kinds of data that need no code of their own.

    loaders.py  which rank sees which samples, loaders, seeding, the batch a dataset gathers
    rows.py     samples held in memory as tensors: a batch in one gather, noise from (seed, epoch, index)
    tables.py   a CSV or Parquet table as training and validation rows: read, checked, split, standardised
    table_shards.py  a table as Parquet shards: written a chunk at a time, read as training rows
    images.py   an image folder as datasets: its layouts and split, decoding, the check of every file
    shards.py   data in shards from a folder or object storage: the index, the node's cache, the order

The names every task's dataset.py may import are here: `from ddp_utils.data import mix_seed, Batch`.
A table's and an image folder's come from their own modules (`from ddp_utils.data.tables import
table_datasets`): importing the shared names loads neither.
"""

from .loaders import Batch, mix_seed

__all__ = ["Batch", "mix_seed"]
