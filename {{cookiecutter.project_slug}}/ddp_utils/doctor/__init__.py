"""doctor.py: the user's model checked on a laptop before it costs GPU hours.

run.py           doctor.py's main: what each check does, the report
processes.py     1 vs 2 real processes, their steps under ddp, fsdp and hsdp
memory.py        the memory plan per GPU, activations measured
equivalence.py   1 vs 2 in one process, an exact resume, the data position, data per rank, fsdp = ddp
model_checks.py  the model's own code: its gradients, shard units, host syncs
rows.py          the report's rows, and the comparisons the checks share
numerics.py      how closely two runs must agree: the model's own precision
"""

from .run import main

__all__ = ["main"]
