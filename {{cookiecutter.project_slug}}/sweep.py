"""Sweep Config fields with Optuna: each trial a training run of the task (task.py) through
scripts/launch.sh. Machinery: ddp_utils/sweep/run.py; this file only hands it the task.
Needs the sweep extra: pip install -e ".[sweep]". docs/sweeps.md has the file's keys.

    python sweep.py experiments/sweep_lr_adamw.toml            # a worker; start as many as you like
    python sweep.py experiments/sweep_lr_adamw.toml --report   # the results so far
    python sweep.py --curves runs/a runs/b --out curves.png     # any runs' loss curves side by side
"""

import sys

from ddp_utils.sweep import main
from task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
