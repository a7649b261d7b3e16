"""Install a tests/ddp_probe.py probe in the training processes of a launch we do not start
ourselves (scripts/launch.sh runs torchrun, which runs train.py).

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH, so a test runs

    PYTHONPATH=tests DDP_PROBE=slow_checkpoint_write[,another] scripts/launch.sh ...

and each worker (torchrun sets LOCAL_RANK; torchrun itself has none) installs the probe before
train.py runs. Probes used this way patch torch or the task's functions, not train.py's classes: train.py runs as
__main__, not as the `train` module the probe imports (model.py and ddp_utils/contract.py are shared).
"""

import os
import sys

if os.environ.get("DDP_PROBE") and "LOCAL_RANK" in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ddp_probe

    for name in os.environ["DDP_PROBE"].split(","):  # "a,b": both probes
        ddp_probe.PROBES[name]()
