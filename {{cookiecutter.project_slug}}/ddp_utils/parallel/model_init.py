"""The model's initial weights, the same under every strategy and any number of processes.

`build_module` builds the task's model as its own code makes it (or on the meta device, to be
materialised shard by shard under fsdp); `shard_units` finds the blocks fsdp shards one by one.
`initial_model` is the model with its initial weights: the one function training (through
`build_module`) and the doctor build it with.
"""

import zlib
from collections import Counter

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..contract import build_on_meta
from ..core.logs import report
from ..data.loaders import mix_seed
from ..errors import ConfigError
from .activation_checkpointing import apply_activation_checkpointing
from .blocks import shard_units


def build_module(cfg, build_model, device, on_meta=False, shard=None):
    """`build_model(cfg)` as `initial_model` makes it, its blocks then checkpointed as
    --activation_checkpointing says (before --compile and the strategy's wrapper)."""
    model = initial_model(cfg, build_model, device, on_meta, shard)
    if checkpointed := apply_activation_checkpointing(model, cfg.activation_checkpointing):
        blocks = shard_units(model)
        kinds = ", ".join(sorted({_class_name(block) for block in blocks}))
        report("activation checkpointing %s: %d of %d blocks (%s)", cfg.activation_checkpointing, checkpointed,
               len(blocks), kinds)  # fmt: skip
    return model


def _class_name(module):
    """The module's own class: FSDP2 makes a subclass of it, FSDP<name>, for each sharded one."""
    return type(module).__mro__[1].__name__ if isinstance(module, FSDPModule) else type(module).__name__


def initial_model(cfg, build_model, device, on_meta=False, shard=None):
    """`build_model(cfg)` on `device` with its initial weights: the same under ddp and fsdp, on
    one process or sharded over many (`shard(unit)` shards one unit in place), and in the
    doctor's process (doctor.run.built), which checks the model training starts from.

    How the weights are made is the model's choice:
    - As built (a model without `init_weights`): `build_model(cfg)` runs on the CPU with torch's
      generator seeded by --seed, and the weights its `__init__` made are kept (a zero-initialised
      head stays zero); the model is then moved to `device`, and sharded unit by unit.
    - Module by module (a model with `init_weights(name, module)`, or --init_on_meta): built on
      the meta device, nothing allocated; each module's own tensors are materialised on the CPU
      and initialised by its `reset_parameters()`, then `init_weights`, from a generator seeded
      by (seed, its name), so the weights depend neither on construction order nor on device;
      each unit (`shard_units`) is sharded before the next is made: a model too big for one
      process never exists whole.
    """
    shard = shard or (lambda unit: None)
    model = build_on_meta(build_model, cfg)
    if model is None or not (on_meta or hasattr(model, "init_weights")):
        if model is None and on_meta:
            raise ConfigError("init_on_meta", "is true, but build_model(cfg) fails on the meta device: set it to false")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = build_model(cfg).to(device)
        for unit in [*shard_units(model), model]:
            shard(unit)
        return model
    done, made = set(), {}
    holders = Counter(id(t) for m in model.modules() for t in _own_tensors(m) if t.is_meta)
    for unit in [*shard_units(model), model]:  # the model last: what no unit holds
        members = set(unit.modules())
        for name, module in model.named_modules():
            if module in done or module not in members:
                continue
            done.add(module)
            # Its own tensors only: materialised on the CPU, initialised there (the CPU
            # generator, whatever the device), then moved.
            materialize(module, made, holders)
            if not init_module(model, name, module, cfg.seed):
                raise ConfigError(
                    "init_on_meta",
                    f"is true, but {name or 'the model'} ({type(module).__name__}) has parameters and no "
                    "reset_parameters(), and the model no init_weights(name, module) to initialise it: set "
                    "--init_on_meta false, or give the model an init_weights",
                )
            module._apply(lambda t: t.to(device), recurse=False)  # in place: tied weights stay tied
        shard(unit)
    return model


def materialize(module, made, holders):
    """Give `module`'s own meta tensors real (uninitialised) CPU memory. A parameter two modules
    share (tied embeddings) becomes one tensor for both: `made` maps each meta tensor's id to
    (it, its copy) until its last holder has it (Module.to_empty would give each holder its
    own, silently untying them); then the entry goes, so sharding can free the whole tensor."""
    for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if tensor.is_meta:
            if id(tensor) not in made:
                copy = torch.empty_like(tensor, device="cpu")
                copy = nn.Parameter(copy, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copy
                made[id(tensor)] = (tensor, copy)  # the meta tensor kept alive: its id stays unique
            setattr(module, name, made[id(tensor)][1])
            holders[id(tensor)] -= 1
            if holders[id(tensor)] == 0:
                del made[id(tensor)]


def _own_tensors(module):
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def init_module(model, name, module, seed):
    """Initialise `module`'s own parameters and buffers, from a generator seeded by its name.

    The module's `reset_parameters()` (PyTorch's defaults), then the model's own scheme where
    it has one (`model.init_weights(name, module)`), which may redraw some of them. Returns
    whether anything initialised it (modules without parameters need nothing)."""
    if not _own_tensors(module):
        return True
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(mix_seed(seed, zlib.crc32(name.encode())))
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if hasattr(model, "init_weights"):
            model.init_weights(name, module)
    return hasattr(module, "reset_parameters") or hasattr(model, "init_weights")
