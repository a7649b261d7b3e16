"""Which device this process trains on, and why not a GPU when none can be used.

- `choose_device` turns --device and LOCAL_RANK into a torch.device, refusing (DeviceError) to
  fall back to the CPU where the job's scheduler or launcher asked for GPUs.
- TF32 matmuls: `set_tf32`, `tf32_settings`.
"""

import os

import torch

from ..errors import DeviceError


def local_gpu(local_rank):
    """This process's GPU: the LOCAL_RANK-th GPU it sees, or its only one.

    Schedulers often show each process just its own GPU (`srun --gpus-per-task=1`,
    CUDA_VISIBLE_DEVICES per rank): that GPU is then cuda:0 whatever LOCAL_RANK is.
    """
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but this process sees {count} GPUs: start at most one process per GPU "
            "(NPROC_PER_NODE), or show each process its own GPU (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


# Values of CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES that ask for no GPU (SLURM writes
# NoDevFiles where a job got none; the NVIDIA container runtime takes void and none).
NO_GPU_VALUES = {"", "-1", "none", "void", "nodevfiles"}


def gpus_requested(environ, nvidia_devices=None):
    """What asked for GPUs, as a short text naming the variable, or None: the job's scheduler
    or launcher gave this process GPUs (SLURM's GPU variables, CUDA_VISIBLE_DEVICES, or
    NVIDIA_VISIBLE_DEVICES set to devices where the NVIDIA driver's device files are:
    NVIDIA's CUDA images set it to `all` in the image itself, also on nodes without GPUs).
    `nvidia_devices`: whether /dev/nvidiactl exists (looked up when None)."""
    if nvidia_devices is None:
        nvidia_devices = os.path.exists("/dev/nvidiactl")
    names = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
    names += ("NVIDIA_VISIBLE_DEVICES",) if nvidia_devices else ()
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip().lower() not in NO_GPU_VALUES:
            return f"{name}={value}"
    if environ.get("SLURM_GPUS_ON_NODE", "0").isdigit() and int(environ.get("SLURM_GPUS_ON_NODE", "0")) > 0:
        return f"SLURM_GPUS_ON_NODE={environ['SLURM_GPUS_ON_NODE']}"
    return None


def cuda_driver_version():
    """The newest CUDA version the NVIDIA driver supports, e.g. (12, 8); None without a driver.
    Read from libcuda itself (cuDriverGetVersion needs no initialised device)."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, version.value % 1000 // 10


def cuda_unavailable_reason():
    """Why torch cannot use CUDA here, in one sentence with the fix."""
    build = f"this torch ({torch.__version__})"
    if torch.version.cuda is None:
        return f"{build} is a CPU-only build: install torch built for the nodes' CUDA (pytorch.org/get-started)"
    needed = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    driver = cuda_driver_version()
    if driver is None:
        return f"{build} is built for CUDA {torch.version.cuda}, but no NVIDIA driver is loaded (libcuda.so.1)"
    supports = f"the NVIDIA driver supports CUDA up to {driver[0]}.{driver[1]}"
    if driver < needed:
        return (
            f"{build} is built for CUDA {torch.version.cuda}, but {supports}: update the driver, or install "
            "torch built for an older CUDA"
        )
    return f"{build} is built for CUDA {torch.version.cuda} and {supports}, yet finds no usable GPU (see nvidia-smi)"


def choose_device(local_rank, device="auto", environ=os.environ):
    """This process's device for `--device` (auto, cuda or cpu). auto takes the GPU when CUDA
    works, and the CPU when no GPU was asked for; GPUs asked for but unusable (a broken driver,
    a torch built for a newer CUDA than the driver's, a CPU-only torch) raise DeviceError rather
    than train every rank at CPU speed."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return local_gpu(local_rank)
    asked = "--device cuda" if device == "cuda" else gpus_requested(environ)
    if asked:
        raise DeviceError(
            f"GPUs were asked for ({asked}) but CUDA is unavailable: {cuda_unavailable_reason()}; "
            "or pass --device cpu to train on the CPU"
        )
    return torch.device("cpu")


def set_tf32(enabled):
    """TF32 (Ampere and newer GPUs) for float32 matmuls and convolutions, or full float32.

    Set through the legacy flags (torch.backends.*.allow_tf32), which torch mirrors into its
    newer `fp32_precision` settings: both APIs then read the same value. Setting only the new
    one would leave the old unreadable ("a mix of the legacy and new APIs"), and Inductor and
    other libraries still read it. Returns what both now say (tf32_settings)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    return tf32_settings()


def tf32_settings():
    """Every TF32 setting by name, as each API reads it (the legacy flags, then the
    `fp32_precision` settings); one that cannot be read raises."""
    backends = torch.backends
    return {
        "cuda.matmul.allow_tf32": backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda.matmul.fp32_precision": backends.cuda.matmul.fp32_precision,
        "cudnn.conv.fp32_precision": backends.cudnn.conv.fp32_precision,
    }
