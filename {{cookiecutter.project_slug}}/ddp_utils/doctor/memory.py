"""doctor.py's memory plan: the bytes per GPU of parameters, gradients, AdamW's state and
activations under ddp, fsdp over every GPU and hsdp, and whether the configured --strategy
fits. The activations are measured (`LiveBytes`), not guessed from shapes. Beside it, what each
rank writes of a checkpoint, and whether --output_dir has room for the kept ones.

Units: the plan is in bytes, printed in binary units (core.units: MiB, GiB), and the GPU's
memory, --gpu_memory_gb, is in GiB (2**30 bytes), as a GPU's spec sheet counts it: an "80GB"
H100 has 80 GiB of memory, of which nvidia-smi shows about 79.6 GiB (81559 MiB) and torch
(torch.cuda.mem_get_info, the out-of-memory line's total) a little less, the driver's share
gone. A strategy fits where its plan is at most 90% of --gpu_memory_gb GiB."""

import copy
import functools
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from ..checkpoint.checkpointer import rank_state
from ..checkpoint.space import (
    as_sharded,
    one_file_bytes,
    optimizer_bytes,
    serialized_bytes,
    sharded_bytes,
    space,
    tensor_bytes,
)
from ..contract import count_samples, model_inputs
from ..core.precision import AMP_DTYPES, autocast
from ..core.units import size_text
from ..optim.optimizer import build_optimizer
from ..parallel.activation_checkpointing import MODES, apply_activation_checkpointing, checkpointable_blocks
from ..parallel.blocks import shard_units
from ..train.out_of_memory import same_global_batch
from .rows import check, halves


class LiveBytes(TorchDispatchMode):
    """The bytes the tensors made under it hold after each operation (`trace`), each storage
    counted once, from when it is made until it is freed: what a forward saves for backward,
    and what it frees sooner (a softmax's intermediate, autocast's copies of the weights)."""

    def __init__(self):
        super().__init__()
        self.live, self.trace = 0, []
        self.held = WeakIdKeyDictionary()  # storage: a reference that says when it is freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            strided = isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided  # sparse ones have none
            storage = tensor.untyped_storage() if strided else None
            if storage is None or storage in self.held or id(storage) in inputs:
                continue  # a view of what exists already
            self.held[storage] = weakref.ref(storage, functools.partial(self.free, storage.nbytes()))
            self.live += storage.nbytes()
        self.trace.append(self.live)
        return out

    def free(self, nbytes, _):
        self.live -= nbytes


def activation_trace(model, batch, loss_fn, amp_dtype, backward=False):
    """The bytes a forward and the loss of `batch` hold after each operation: what they save
    for backward and what they hold for a while; with `backward`, through the backward too
    (where activation checkpointing peaks: a block's forward runs again there), the gradients
    accumulated into ones that exist already (the memory plan counts those apart)."""
    if backward:
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
    with LiveBytes() as tracked:
        with autocast("cpu", amp_dtype):
            loss = loss_fn(model(model_inputs(batch)), batch)
        if backward:
            loss.backward()
    del loss
    return tracked.trace


def activations_at(model, batch, loss_fn, cfg, backward=False):
    """The peak activations of --batch_size samples (`scaled_peak`). With `backward`, through the
    backward too, where activation checkpointing peaks (a block's forward runs again there): the
    step's excess over the forward's peak is measured in float32 (a CPU's bfloat16 backward is
    slow) and taken to --amp's precision in the proportion of the two forwards."""
    amp_dtype = AMP_DTYPES[cfg.amp]
    peak = scaled_peak(model, batch, loss_fn, cfg, amp_dtype)
    if backward:
        forward = peak if amp_dtype is None else scaled_peak(model, batch, loss_fn, cfg, None)
        step = scaled_peak(model, batch, loss_fn, cfg, None, backward=True)
        peak += max(0.0, step - forward) * (peak / forward if forward else 1.0)
    return peak


def scaled_peak(model, batch, loss_fn, cfg, amp_dtype, backward=False):
    """The peak of activation_trace for --batch_size samples. The bytes held after each
    operation are measured on the first half of `batch` and on the whole of it, and each is
    taken along the line through the two (what does not grow with the batch, such as autocast's
    copies of the weights, counted once): the peak is where the largest of them is at
    --batch_size, which need not be where it is for a few samples. Scaled from the whole when it
    has one sample or the operations differ with the batch's size."""
    samples = count_samples(batch)
    whole = activation_trace(model, batch, loss_fn, amp_dtype, backward)
    half_samples = samples // 2
    half = tree_map_only(torch.Tensor, torch.clone, halves(batch)[0])  # its own storage, not the batch's
    half = activation_trace(model, half, loss_fn, amp_dtype, backward) if half_samples else []
    if len(half) != len(whole):
        return max(whole, default=0) * cfg.batch_size / samples
    slopes = [(b - a) / (samples - half_samples) for a, b in zip(half, whole)]
    return max((b + slope * (cfg.batch_size - samples) for b, slope in zip(whole, slopes)), default=0.0)


def replicas(cfg, world_size, gpus_per_node):
    """The replicas --strategy fsdp keeps at this size (ddp_utils.parallel.strategy.hsdp_replicas)."""
    return cfg.replicate_degree or (world_size // gpus_per_node if gpus_per_node > 1 else 1)


def checkpointed(model, mode):
    """`model` as --activation_checkpointing `mode` makes it in training: a copy, its blocks checkpointed."""
    if mode == "none":
        return model
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, mode)
    return model


def mode_activations(model, batch, loss_fn, cfg, mode, backward=None):
    """The peak activations under --activation_checkpointing `mode`, on a copy of `model` (its
    gradients are made): through the backward, where a mode peaks (its recompute), by default
    with a mode on; `backward` True for none too, to compare the modes with it on the step's
    peak (the activations' gradients beside what the forward kept)."""
    backward = mode != "none" if backward is None else backward
    model = copy.deepcopy(model) if mode == "none" and backward else checkpointed(model, mode)
    return activations_at(model, batch, loss_fn, cfg, backward=backward)


def memory_plan(model, batch, loss_fn, cfg, world_size, gpus_per_node, activations=None):
    """Bytes per GPU under ddp, fsdp over every GPU and hsdp (fsdp in replicas), and the flags
    of each: ({name: {part: bytes}}, {name: flags}, the configured one's name). `activations`:
    measured already (checkpointing_plan's, for the configured mode), else measured here."""
    parameters = list(model.parameters())  # bytes as built (float32, unless the model says otherwise)
    trainable = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in parameters) - trainable
    element = parameters[0].element_size() if parameters else 4
    compute = 2 if AMP_DTYPES[cfg.amp] is not None else element  # a parameter gathered for compute under fsdp
    if activations is None:
        activations = mode_activations(model, batch, loss_fn, cfg, cfg.activation_checkpointing)
    largest_unit = max((sum(p.numel() for p in unit.parameters()) for unit in shard_units(model)), default=0)
    largest_unit = largest_unit or sum(p.numel() for p in parameters)  # no units: the whole model is one
    default = replicas(cfg, world_size, gpus_per_node)
    hsdp = default if default > 1 else (world_size // gpus_per_node if gpus_per_node > 1 else 1)
    candidates = {
        "ddp": (1, "--strategy ddp"),
        "fsdp": (world_size, "--strategy fsdp" + (" --replicate_degree 1" if default != 1 else "")),
        "hsdp": (world_size // hsdp, "--strategy fsdp" + (f" --replicate_degree {hsdp}" if hsdp != default else "")),
    }
    plans, flags = {}, {}
    for name, (shards, flag) in candidates.items():
        if name == "hsdp" and (shards in (1, world_size) or world_size % hsdp):
            continue  # the same as ddp or fsdp here
        plans[name] = {
            "parameters": (trainable + frozen) / shards,
            "gradients": trainable / shards,
            "optimizer": 2 * trainable / shards,  # AdamW's two moments, as the parameters
            "activations": activations,
        }
        if shards > 1:  # a unit gathered for its forward or backward and the next one prefetched; one unit's gradients
            plans[name]["gathered"] = largest_unit * (2 * compute + element)
        elif name == "ddp" and not cfg.gradient_as_bucket_view:
            plans[name]["buckets"] = trainable  # DDP's buckets, a second copy of the gradients
        flags[name] = flag
    if cfg.cpu_offload:  # the shards, their gradients and AdamW's state in host memory: a unit at a time on the GPU
        for plan in [plans[name] for name in ("fsdp", "hsdp") if name in plans]:
            plan.update(parameters=0, gradients=0, optimizer=0, gathered=largest_unit * (2 * compute + element))
    if cfg.strategy == "ddp":
        configured = "ddp"
    elif world_size % default:
        configured = None  # training refuses it (ddp_utils.parallel.strategy.hsdp_replicas)
    else:
        configured = "fsdp" if default == 1 else "hsdp" if "hsdp" in plans and hsdp == default else "ddp"
    return plans, flags, configured


def memory_check(plans, flags, configured, cfg, gpu_gb, world_size, checkpointing=None):
    """The memory plan's row: `plans` (bytes per GPU) against a GPU of `gpu_gb` GiB (--gpu_memory_gb);
    `checkpointing`: the mode the activation checkpointing row names, where it names one."""
    totals = {name: sum(plan.values()) for name, plan in plans.items()}  # bytes
    summary = ", ".join(f"{name} {size_text(total)}" for name, total in totals.items())
    summary += f" per GPU at {world_size} GPUs, --batch_size {cfg.batch_size}, --amp {cfg.amp}"
    gpu = f"{gpu_gb:g} GiB"  # --gpu_memory_gb as given, in its unit
    usable = 0.9 * gpu_gb * 2**30  # a tenth to fragmentation, the CUDA context
    fits = {name: total <= usable for name, total in totals.items()}
    if configured is None:
        why = f"--replicate_degree {cfg.replicate_degree} does not divide the {world_size} GPUs"
        return check("memory plan", "fail", f"{summary}: {why}", "a --replicate_degree that divides them")
    if fits[configured]:
        return check("memory plan", "pass", f"{summary}: {configured} fits {gpu}")
    activations = plans[configured]["activations"]
    fixes = [flags[name] for name in plans if fits[name]]
    state = sum(plans[configured].get(part, 0) for part in ("parameters", "gradients", "optimizer"))
    if configured != "ddp" and not cfg.cpu_offload and totals[configured] - state <= usable:
        fixes.append(f"--cpu_offload (the sharded state, {size_text(state)} per GPU, in host memory)")
    if not fixes and totals[configured] - activations > 0.3 * totals[configured]:
        fixes.append("more GPUs with --strategy fsdp (the model state shards over them)")
    if activations > 0.3 * totals[configured]:
        if cfg.activation_checkpointing == "none":
            fixes.append(checkpointing or "--activation_checkpointing full")
        if smaller := same_global_batch(cfg):
            fixes.append(smaller)
    status = "warn" if any(fits.values()) else "fail"
    return check("memory plan", status, f"{summary}: {configured} does not fit {gpu}", "; or ".join(fixes))


def checkpointing_plan(model, batch, loss_fn, cfg):
    """Each --activation_checkpointing mode measured on `model`: the activations at --batch_size
    (bytes per GPU, as memory_plan measures them) and the recompute's cost, the extra training
    FLOPs over none's (a share: 0.33 is a third more), counted by FlopCounterMode as a step of
    one sample of `batch` runs here (each sample costs the same), each mode on a copy.
    {mode: {"activations", "recompute_flops"}}; {} for a model with no blocks to checkpoint
    (which refuses the knob)."""
    if not checkpointable_blocks(model):
        return {}
    plan, counted = {}, {}
    one = tree_map_only(torch.Tensor, lambda t: t[:1], batch)
    with torch.random.fork_rng(devices=[]):  # the checks after this one draw as they would have
        for mode in MODES:
            activations = mode_activations(model, batch, loss_fn, cfg, mode, backward=True)  # all on the step's peak
            copied = copy.deepcopy(model) if mode == "none" else checkpointed(model, mode)
            with FlopCounterMode(display=False) as counter:
                loss_fn(copied(model_inputs(one)), one).backward()  # the backward runs the recompute
            counted[mode] = counter.get_total_flops()
            plan[mode] = {"activations": activations}
    for mode in MODES:
        plan[mode]["recompute_flops"] = counted[mode] / counted["none"] - 1 if counted["none"] else 0.0
    return plan


def checkpointing_check(modes, plans, configured, cfg, gpu_gb):
    """The row of --activation_checkpointing: each mode's activations per GPU and its recompute,
    and the mode of least recompute with which the configured strategy fits a GPU of `gpu_gb` GiB."""
    name = "activation checkpointing"
    if not modes:
        summary = "not available: the model has no blocks of several layers to checkpoint (its blocks: shard units)"
        return check(name, "pass", summary, "give the model a shard_units() method returning them")
    figures = [
        f"{mode} {size_text(m['activations'])}" + (f" (+{m['recompute_flops']:.0%} FLOPs)" if mode != "none" else "")
        for mode, m in modes.items()
    ]
    summary = f"activations per GPU at --batch_size {cfg.batch_size}: " + ", ".join(figures)
    if configured is None:
        return check(name, "pass", summary)
    plan, mode = plans[configured], cfg.activation_checkpointing
    rest = sum(plan.values()) - plan["activations"]  # what does not depend on the mode
    usable = 0.9 * gpu_gb * 2**30  # as memory_check judges
    fits = [m for m in modes if rest + modes[m]["activations"] <= usable]
    gpu = f"{gpu_gb:g} GiB"
    if not fits:
        return check(name, "warn", f"{summary}; {configured} fits {gpu} with no mode", "see the memory plan's row")
    best = min(fits, key=lambda m: modes[m]["recompute_flops"])  # the least recompute; the first of MODES on a tie
    cost = "no recompute" if best == "none" else f"+{modes[best]['recompute_flops']:.0%} FLOPs"
    fix = f"--activation_checkpointing {best} ({size_text(modes[best]['activations'])} of activations, {cost})"
    if mode not in fits:
        return check(name, "warn", f"{summary}; {configured} does not fit {gpu} with {mode}", fix)
    if modes[best]["recompute_flops"] < modes[mode]["recompute_flops"]:  # a cheaper mode fits too
        return check(name, "pass", f"{summary}; {configured} fits {gpu} with {mode}, and with {best}", fix)
    return check(name, "pass", f"{summary}; {configured} fits {gpu} with {mode}")


def checkpoint_plan(model, cfg, world_size):
    """The bytes of one checkpoint of `model` and what each rank writes of it, under ddp (rank 0
    writes it all) and under fsdp or hsdp over `world_size` GPUs (every rank its shards, DCP
    writing each once): {name: {"checkpoint", "rank 0", "each other rank"}}. Counted as training
    counts them (checkpoint_space): the model's tensors, the optimizer's state as build_optimizer's
    will hold it, each rank's random generators as this process's; the training set's
    data_state() is left out."""
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    trainer = serialized_bytes({"config": cfg.to_dict()})
    trainer += world_size * serialized_bytes(rank_state(torch.zeros(2, dtype=torch.float64)))
    state = model.state_dict()
    ddp = one_file_bytes(tensor_bytes(state) + optimizer_bytes(optimizer), trainer)
    spread = as_sharded(tensor_bytes(state, once=False) + optimizer_bytes(optimizer), world_size)
    whole, first = sharded_bytes(spread, world_size, trainer, main=True)
    other = sharded_bytes(spread, world_size, trainer, main=False)[1]
    return {
        "ddp": {"checkpoint": ddp, "rank 0": ddp, "each other rank": 0},
        "fsdp": {"checkpoint": whole, "rank 0": first, "each other rank": other},
    }


def checkpoint_check(plan, cfg, world_size):
    """The doctor's row of checkpoints: what each rank writes of one under ddp and fsdp, and
    whether this machine's --output_dir holds the kept ones at their peak under the configured
    --strategy. A warning at most: the job's file system is the preflight's to check."""
    ddp, fsdp = plan["ddp"], plan["fsdp"]
    sizes = (
        f"a checkpoint of {size_text(ddp['checkpoint'])} under ddp, all from rank 0; under fsdp "
        f"{size_text(fsdp['each other rank'])} from each of the {world_size} GPUs ({size_text(fsdp['rank 0'])} from "
        "rank 0, with the trainer's state)"
    )
    size = plan["fsdp" if cfg.strategy == "fsdp" else "ddp"]["checkpoint"]
    room = space(Path(cfg.output_dir) / "checkpoints", size, cfg.keep_checkpoints)
    if room.shortfall():
        return check("checkpoint space", "warn", f"{sizes}; {room.shortfall()}", room.fix())
    return check("checkpoint space", "pass", f"{sizes}; {room.summary()}")
