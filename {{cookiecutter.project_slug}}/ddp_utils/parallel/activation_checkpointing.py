"""--activation_checkpointing: a block's activations dropped after its forward and recomputed in
the backward, for any model: the blocks are the units fsdp shards (model_init.shard_units: the
model's `shard_units()`, else the children of its largest ModuleList or Sequential).

- none: every activation kept (the fastest step, the most memory).
- full: each block keeps only its input; its forward runs again in the backward.
- every_other: blocks 0, 2, 4, ... as under full, the others keep theirs: about half the saving
  for half the recompute.
- ops: each block keeps the outputs of its costly operations (matmuls, every other one of the
  linear layers', attention, convolutions) and recomputes the cheap ones between them
  (normalisations, activations, dropout): torchtitan's selective checkpointing.

The block's own forward is checkpointed, inside the module call, so the strategy's hooks (DDP's,
FSDP2's all-gathers) stay outside it, the block keeps its class and the state dict its keys.
Non-reentrant (reentrant checkpointing breaks DDP: "marked ready twice"), with the random
generators restored for the recompute: dropout draws the same masks, a run is the same run with
or without it. Applied before --compile, which then compiles the checkpointed forward.
"""

import contextlib
import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import ConfigError
from .blocks import shard_units

MODES = ("none", "full", "every_other", "ops")
ALIASES = {"true": "full", "false": "none"}  # the yes/no knob of projects made before

aten = torch.ops.aten
# The operations whose outputs --activation_checkpointing ops keeps: the costly ones to recompute.
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.linear.default,
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
}
ALTERNATE_OPS = {aten.mm.default, aten.addmm.default, aten.linear.default}  # every other one kept, as torchtitan does


def checkpointable_blocks(model):
    """The blocks checkpointing can save memory in: `model`'s blocks (shard_units) unless there
    are none, or each is a single layer (a Linear, a convolution), which keeps only its input
    for the backward anyway: [] then."""
    blocks = shard_units(model)
    return blocks if any(next(block.children(), None) is not None for block in blocks) else []


def apply_activation_checkpointing(model, mode):
    """Checkpoint `model`'s blocks as `mode` says; returns the number checkpointed. A model whose
    blocks cannot be found, or are single layers, refuses any mode but none, naming the fix."""
    if mode == "none":
        return 0
    blocks = checkpointable_blocks(model)
    if not blocks:
        layers = sorted({type(block).__name__ for block in shard_units(model)})
        why = (
            f"its blocks are single layers ({', '.join(layers)}), each keeping only its input already: nothing to save"
            if layers
            else "it has no blocks to checkpoint (no nn.ModuleList or nn.Sequential of layers)"
        )
        raise ConfigError(
            "activation_checkpointing",
            f"{mode}: {type(model).__name__}: {why}; give it a shard_units() method returning blocks of several "
            "layers, or set --activation_checkpointing none",
        )
    for block in blocks:
        if getattr(block, "gradient_checkpointing", False):
            raise ConfigError(
                "activation_checkpointing",
                f"{mode}: {type(block).__name__} checkpoints itself already (Hugging Face's gradient checkpointing "
                "is on): leave it off in build_model and let this knob do it",
            )
    _caches_off(model)
    chosen = blocks[::2] if mode == "every_other" else blocks
    for block in chosen:
        checkpoint_block(block, ops=mode == "ops")
    return len(chosen)


def _caches_off(model):
    """A Hugging Face model builds a key/value cache in its forward unless its config says not to
    (`use_cache`); the recompute would write to it a second time (keys twice as long as the
    mask). Training never reads it, so it is turned off, as transformers' own checkpointing does."""
    for module in model.modules():
        if getattr(getattr(module, "config", None), "use_cache", False) is True:
            module.config.use_cache = False


def checkpoint_block(block, ops=False):
    """Make `block`'s forward a checkpointed one (`ops`: keep its costly operations' outputs)."""
    context = functools.partial(recompute_contexts, block, keep_policy if ops else None)
    block._checkpoint_forward = functools.partial(
        checkpoint, use_reentrant=False, preserve_rng_state=True, context_fn=context
    )
    # A method bound to the block (not a closure): a deep copy of the model keeps it working on
    # the copy; the class's forward runs inside, so hooks and the class stay as they were.
    block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(self, *args, **kwargs):
    inner = type(self).forward.__get__(self)
    # The keyword arguments travel inside a positional one: checkpoint looks for the devices
    # whose random generators it restores among its positional arguments only.
    return self._checkpoint_forward(_call, inner, args, kwargs)


def _call(function, args, kwargs):
    return function(*args, **kwargs)


def keep_policy():
    """A fresh policy per block call: which operations' outputs are kept. The forward and the
    recompute count the matmuls apart, so both pick the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in ALTERNATE_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def recompute_contexts(block, make_policy):
    """(forward context, recompute context) for one call of `block`, `make_policy` None under
    full. In eager mode the recompute must not update batch norms' running statistics again."""
    if torch.compiler.is_compiling():  # the compiled backward replays no buffer update
        return create_selective_checkpoint_contexts(make_policy() if make_policy else _recompute_everything)
    if make_policy is None:
        return contextlib.nullcontext(), _statistics_frozen(block)
    forward, recompute = create_selective_checkpoint_contexts(make_policy())
    return forward, _both(_statistics_frozen(block), recompute)  # the freezing outside the recording


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


@contextlib.contextmanager
def _statistics_frozen(block):
    """Batch norms in `block` leave their running statistics as they are (momentum 0, the count
    put back without a version bump) while the recompute runs."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.detach().clone()) for m in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, saved):
            norm.momentum = momentum
            norm.num_batches_tracked.data.copy_(count)
