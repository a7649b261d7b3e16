"""--amp: the autocast dtypes and the one autocast context every forward runs under."""

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def autocast(device, amp_dtype):
    """Autocast to `amp_dtype` on `device` (a torch.device or its type), or a no-op for None."""
    device_type = device if isinstance(device, str) else device.type
    return torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None)


def loss_scale(scaler):
    """GradScaler's current scale as a tensor on the device (a copy: update() changes it in place)."""
    return scaler._get_scale_async().clone()
