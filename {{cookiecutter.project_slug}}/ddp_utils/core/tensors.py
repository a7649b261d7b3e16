"""What a tensor holds on this rank: a DTensor's local shard, or the tensor itself."""

from torch.distributed.tensor import DTensor


def local(tensor):
    """A tensor's data on this rank: a DTensor's local shard (under no_grad the very tensor the
    DTensor holds: changed in place, it changes the parameter), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
