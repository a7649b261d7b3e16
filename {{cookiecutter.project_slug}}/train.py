"""Train the task (task.py) with PyTorch DistributedDataParallel, or fully sharded (--strategy
fsdp). Machinery: ddp_utils/train/run.py starts the loop (ddp_utils/train/trainer.py); this file only hands
it the task.

The same script runs as one process or many:

    python train.py --config experiments/quick_cpu.toml
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2 --strategy fsdp
"""

import sys

from ddp_utils.train import main
from task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
