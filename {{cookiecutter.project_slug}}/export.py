"""Write a checkpoint's model as one file (or, with --format hf, a Hugging Face folder) for
inference and sharing. Machinery: ddp_utils/export.py says what OUT holds; this file only hands
it the task (task.py).

    python export.py runs/default/checkpoints/last model.pt
    python export.py runs/default/checkpoints/last model_hf --format hf
"""

import sys

from ddp_utils.export import main
from task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
