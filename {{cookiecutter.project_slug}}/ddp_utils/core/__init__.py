"""The bottom floor: what every other part uses and that knows nothing of training.

logs.py       rank-aware logging (`rank_zero_only`), the launcher's rank, the one-line error, an error's first line
files.py      files and folders written whole or not at all, fenced by the folder claim
units.py      byte sizes in words: one unit for every line the project prints
tensors.py    what a tensor holds on this rank: a DTensor's local shard
compat.py     bridges between the torch releases the project supports
precision.py  --amp: the autocast dtypes and the one autocast context
collector.py  Python's garbage collector kept out of the training steps
"""
