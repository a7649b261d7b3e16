"""preflight.py: on the job's own nodes, whether more nodes train this task faster.

run.py           preflight.py's main: the job's step timed, what the network costs, the verdict
local_checks.py  the checks of one process before it joins: its place, its GPU, its network identity
measure.py       the measurements once joined: a collective, all-reduce bandwidth, the checkpoint write
comm_model.py    what gradients cost to send: the prediction of a job's step
"""

from .run import main

__all__ = ["main"]
