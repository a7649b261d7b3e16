"""What the ranks agree on without making the host wait for the device.

- `Agreement` sums flags and values over every rank in one all-reduce the host does not wait for.
- `HostCopy`: a device tensor's values read a step later, without a synchronisation.
"""

import torch
import torch.distributed as dist


class HostCopy:
    """A tensor copied to the host without making the host wait for the device.

    On CUDA the copy goes to pinned memory behind the work already queued; `tolist()` waits
    only for that copy (an event), so read it a step later and it is long done. On the CPU
    there is nothing to wait for.
    """

    def __init__(self, tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def tolist(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Agreement:
    """Values summed over all ranks by one all-reduce that runs while the host goes on.

    A flag (0 or 1) summed is the number of ranks that raised it; a tensor's value summed is
    finite only if it is finite on every rank (NaN and inf survive a sum), so neither needs an
    operation of its own before the all-reduce. `result()` gives the sums; the training loop
    reads them one optimizer step after starting the all-reduce, so it never waits for the
    device (trainer.py, optimizer_step; faults.StepChecks).
    """

    def __init__(self, values, device):
        if device.type == "cpu":  # reading a CPU tensor costs nothing: one tensor from the values
            summed = torch.tensor([float(value) for value in values], dtype=torch.float64)
        else:  # on the device: a tensor made from a Python value would be a blocking copy
            summed = torch.stack([on_device(value, device) for value in values])
        work = dist.all_reduce(summed, async_op=True)
        if device.type == "cuda":
            work.wait()  # orders the copy after the all-reduce on the GPU; the host goes on
            self.work, self.copy = None, HostCopy(summed)
        else:
            self.work, self.copy = work, HostCopy(summed)

    def wait(self):
        """Until the all-reduce is done on the host's side (no collective left in flight)."""
        if self.work is not None:
            self.work.wait()

    def result(self):
        self.wait()
        return self.copy.tolist()


def on_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def any_rank(*flags, device):
    """True for each flag that is true on at least one rank: one all-reduce for all flags, waited for."""
    return [total > 0 for total in Agreement(flags, device).result()]
