"""Check a cluster before a long job, under the same launcher as training: each process's
place, GPU and network identity, a collective, all-reduce bandwidth, and a verdict on whether
more nodes train this task (task.py) faster. Machinery: ddp_utils/preflight/run.py says how; this
file only hands it the task.

    scripts/launch.sh --preflight [--json] [train.py flags]   # every node, as for training
    torchrun --standalone --nproc_per_node=2 preflight.py [--json]
"""

import sys

from ddp_utils.preflight import main
from task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
