"""preflight.py: on the job's own nodes, whether more nodes train this task faster.

run.py         preflight.py's main: the job's step timed, what the network costs, the verdict
checks.py      the checks of one process and its network measurements
comm_model.py  what gradients cost to send: the prediction of a job's step
"""

from .run import main

__all__ = ["main"]
