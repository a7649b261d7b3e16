"""Install a tests/ddp_probe.py probe in the training processes of a launch we do not start
ourselves (scripts/launch.sh runs torchrun, which runs train.py).

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH, so a test runs

    PYTHONPATH=tests DDP_PROBE=slow_checkpoint_write[,another] scripts/launch.sh ...

and each worker (torchrun sets LOCAL_RANK; torchrun itself has none) installs the probe before
train.py runs: it patches ddp_utils' classes or the task (task.TASK), which train.py then imports.

It also makes every Python process of a test answer as on a machine with a GPU, which this
CPU machine is not (the GPU host's code paths, whatever the process: torchrun's workers, the
doctor's 2 processes):

    PYTHONPATH=tests FAKE_GPU_HOST=accelerator ...     torch's accelerator query says cuda
    PYTHONPATH=tests FAKE_GPU_HOST=cuda_available ...  and, to the task's build_model(cfg),
                                                        torch.cuda.is_available() is True

Nothing can run on that GPU: code that tries fails as torch without CUDA does. (Only the
model's build is told CUDA works: everything else that asks would go on to use it and fail.)
"""

import os
import sys

if os.environ.get("FAKE_GPU_HOST") in ("accelerator", "cuda_available"):
    import torch

    torch._C._get_accelerator = lambda: torch.device("cuda")  # what FSDP2 and DeviceMesh consult
    if os.environ["FAKE_GPU_HOST"] == "cuda_available":
        cuda_is_available = torch.cuda.is_available

        def is_available():
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_name == "build_model":
                    return True
                frame = frame.f_back
            return cuda_is_available()

        torch.cuda.is_available = is_available

if os.environ.get("DDP_PROBE") and "LOCAL_RANK" in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ddp_probe

    for name in os.environ["DDP_PROBE"].split(","):  # "a,b": both probes
        ddp_probe.PROBES[name]()
