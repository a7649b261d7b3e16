"""sweep.py: short runs of an Optuna study before the long run is paid for.

run.py      sweep.py's main: a worker of an Optuna study, each trial a training run
results.py  a sweep's table, best config and pictures; any runs' loss curves
trial.py    one trial: scripts/launch.sh started, its metrics followed, stopped, judged
file.py     a sweep file read and checked: knobs, ranges, metric, the trials' flags
"""

from .run import main

__all__ = ["main"]
