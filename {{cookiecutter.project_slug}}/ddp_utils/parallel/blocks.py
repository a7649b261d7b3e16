"""A model's blocks: the units --strategy fsdp shards one by one and --activation_checkpointing
recomputes, found the same way for both."""

from torch import nn


def shard_units(model):
    """The blocks FSDP shards one by one (a transformer layer, a ResNet stage): the model's
    `shard_units()` if it says; else the children of its largest `nn.ModuleList` or
    `nn.Sequential` (an `nn.TransformerEncoder`'s layers, an MLP's layers) that hold
    parameters. The rest goes with the whole model, sharded last."""
    if hasattr(model, "shard_units"):
        return list(model.shard_units())
    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not containers:
        return []

    def blocks(container):
        return [child for child in container.children() if _parameter_count(child)]

    largest = max(containers, key=lambda m: (_parameter_count(m), len(blocks(m))))
    return blocks(largest)


def _parameter_count(module):
    return sum(p.numel() for p in module.parameters())
