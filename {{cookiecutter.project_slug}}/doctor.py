"""Check your model and data on a laptop before renting GPUs: the doctor runs each guarantee the
training relies on against the task (task.py) and prints pass, warn or fail with the fix.
Machinery: ddp_utils/doctor/run.py says what each check does; this file only hands it the task.

    python doctor.py [train.py flags]                    # on the CPU; no GPU needed
    python doctor.py --gpu_memory_gb 40 --nodes 4 --gpus_per_node 8 --batch_size 64
"""

import sys

from ddp_utils.doctor import main
from task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
