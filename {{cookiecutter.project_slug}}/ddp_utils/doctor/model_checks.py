"""The checks of the model's own code: its gradients (parameters that get none, entries zero in
exact arithmetic, non-finite values), the units --strategy fsdp shards (and a meta-device
start), and calls that make the host wait for the GPU. Each returns a row (rows.check)."""

import ast
import copy
import math
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..contract import count_samples, model_inputs, to_device
from ..core.logs import first_line
from ..core.precision import AMP_DTYPES, autocast
from ..errors import ConfigError
from ..parallel.blocks import shard_units
from ..parallel.model_init import build_module
from .numerics import EXACT, NOISE
from .rows import ERROR_LIMIT, check, to_float64

PACKAGE = Path(__file__).resolve().parents[1]  # ddp_utils, every folder of it: the machinery


PROJECT = PACKAGE.parent  # the project: its own code, not this package's


HOST_SYNCS = ("item", "tolist", "cpu", "numpy")


# What torch.cuda.set_sync_debug_mode("warn") says at each sync (c10/cuda/CUDAFunctions.cpp). Its
# first call in a process also warns that the mode "is a prototype feature and does not yet
# detect all synchronizing operations": no sync (on an H200, that note alone made every task WARN).
SYNC_WARNING = "called a synchronizing CUDA operation"


TOLERANCE = NOISE * EXACT  # a float64 gradient entry this small against the largest is zero in exact arithmetic


def gradient_checks(model, batches, loss_fn, cfg):
    """Rows for a float64 forward and backward of `model` (changed to float64 in place) on the
    first of two `batches`; the second is for zero_gradient_check."""
    model.double().train()
    batch, other = map(to_float64, batches)
    loss = loss_fn(model(model_inputs(batch)), batch)
    loss.backward()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    rows = []
    if not math.isfinite(loss.item()) or any(p.grad is not None and not p.grad.isfinite().all() for _, p in named):
        bad = [name for name, p in named if p.grad is not None and not p.grad.isfinite().all()]
        where = f"gradients of {', '.join(bad[:3])}" if bad else "the loss"
        rows.append(check("non-finite values", "fail", f"{where} not finite in float64", "fix the model or loss: "
                          "a log or division of 0, an overflowing exp"))  # fmt: skip
    else:
        rows.append(check("non-finite values", "pass", f"loss {loss.item():.4g}, every gradient finite"))
    unused = [name for name, p in named if p.grad is None]
    rows.append(zero_gradient_check(model, named, other, loss_fn))
    sometimes = [name for name in unused_by_some(model, named, batch, loss_fn) if name not in unused]
    status = "warn" if cfg.find_unused_parameters else "fail"
    if unused:
        rows.insert(1, check("unused parameters", status, f"no gradient for {listed(unused)}",
                             "use them in forward, freeze them (requires_grad=False), or set --find_unused_parameters "
                             "true (slower: DDP then searches the graph every step)"))  # fmt: skip
    elif sometimes:
        why = (
            f"no gradient from some samples for {listed(sometimes)} (a mixture of experts' expert that gets no "
            "token, a branch taken by some inputs only): DDP stops at the step after one that leaves them out"
        )
        fix = "set --find_unused_parameters true (slower: DDP then searches the graph every step)"
        rows.insert(1, check("unused parameters", "pass" if cfg.find_unused_parameters else "fail", why, fix))
    else:
        why = f"all {len(named)} trainable parameters get a gradient, from every sample alike"
        rows.insert(1, check("unused parameters", "pass", why))
    return rows


def listed(names):
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


SHARES = 4  # unused_by_some's shares of a batch, of 2 samples each (a batch norm needs 2)


def unused_by_some(model, named, batch, loss_fn):
    """The parameters that get no gradient from some of SHARES shares of `batch`: a mixture of
    experts' experts that get no token, say. None found where a share cannot run alone."""
    found = {}
    try:
        for share in range(min(SHARES, count_samples(batch) // 2)):
            part = tree_map_only(torch.Tensor, lambda t, share=share: t[2 * share : 2 * share + 2], batch)
            model.zero_grad(set_to_none=True)
            loss_fn(model(model_inputs(part)), part).backward()
            found.update((name, None) for name, p in named if p.grad is None)
    except Exception:  # noqa: BLE001 - a model that needs more samples at once: nothing to tell
        return []
    finally:
        model.zero_grad(set_to_none=True)
    return list(found)


def zero_gradient_check(model, named, other, loss_fn):
    """Gradient entries zero in exact arithmetic but not in floating point: not 0.0, yet below
    TOLERANCE times the largest entry in float64 (rounding leaves ~1e-16 where the math says
    0, as sums that cancel do), at the initial weights and again at
    randomly moved ones on `other` samples: a zero-initialised gain silences its branch at the
    start only, a ReLU is dead for some samples only. An embedding's rows of tokens a batch
    lacks are zero for that batch only: left out."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    named = [(name, p) for name, p in named if p.grad is not None and id(p) not in embeddings]

    def tiny_entries():
        largest = max((p.grad.abs().max().item() for _, p in named if p.grad is not None), default=0.0)
        grads = [(name, p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in named]
        return {name: grad.abs() <= TOLERANCE * largest for name, grad in grads}, largest

    zero, largest = tiny_entries()
    if largest == 0:
        return check("zero gradients", "fail", "every gradient is zero", "the loss does not depend on the parameters")
    # Exactly 0.0 (a dead ReLU, an input always 0) moves nothing: AdamW's step is 0 too. Rounding
    # noise where the math says 0 is what AdamW scales up.
    zero = {name: mask & (p.grad != 0) for (name, mask), (_, p) in zip(zero.items(), named)}
    if any(mask.any() for mask in zero.values()):
        moved = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (p.abs().mean() + 0.01) * torch.randn(p.shape, generator=moved, dtype=p.dtype))
        model.zero_grad()
        loss_fn(model(model_inputs(other)), other).backward()
        zero = {name: mask & again for (name, mask), again in zip(zero.items(), tiny_entries()[0].values())}
    found = [(name, int(mask.sum()), mask.numel()) for name, mask in zero.items() if mask.any()]
    if not found:
        return check("zero gradients", "pass", "no gradient entry is zero in exact arithmetic")
    listed = ", ".join(f"{name} ({count} of {total})" for name, count, total in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return check(
        "zero gradients", "warn", f"zero in exact arithmetic: {listed}{more}",
        "such entries (an attention key bias: softmax ignores it) get float32 rounding noise for a gradient, which "
        "AdamW scales to full steps: remove them, or freeze them (requires_grad=False)",
    )  # fmt: skip


def sharding_check(build_model, model, cfg):
    """The units --strategy fsdp shards one by one (each gathered whole for its forward and
    backward), and whether each module can start on the meta device (--init_on_meta: a model
    too big for one process never exists whole)."""
    units = shard_units(model)
    total = sum(p.numel() for p in model.parameters()) or 1
    if not units:
        why = "fsdp finds no blocks to shard one by one: it gathers the whole model at once"
        return check("shard units", "warn", why, "give the model shard_units() (its blocks), or a ModuleList of them")
    in_units = {id(p) for unit in units for p in unit.parameters()}
    largest = max(sum(p.numel() for p in unit.parameters()) for unit in units)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    summary = (f"{len(units)} {type(units[0]).__name__} units of at most {largest / total:.0%} of the parameters, "
               f"{rest / total:.0%} with the whole model")  # fmt: skip
    try:
        build_module(cfg, build_model, torch.device("cpu"), on_meta=True)
    except ConfigError as error:  # "is true, but <why>: set ..."
        why = error.problem.removeprefix("is true, but ").split(": set ")[0]
        fix = "give the model init_weights(name, module) (model.py), or keep --init_on_meta false"
        status = "fail" if cfg.init_on_meta else "warn"
        return check("shard units", status, f"{summary}; on the meta device, {why}", fix)
    return check("shard units", "pass", f"{summary}; every module starts on the meta device too")


def host_sync_check(paths):
    """Calls that make the host wait for the GPU, in the forward and loss functions of `paths`."""
    found = []
    for path in paths:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef) or function.name not in ("forward", "loss_fn"):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_SYNCS:
                    where = f"{Path(path).name}:{node.lineno}"
                    found.append((str(path), node.lineno, f"{where} .{node.func.attr}() in {function.name}"))
    found = [text for _, _, text in sorted(found)]
    if not found:
        return check("host syncs", "pass", "no .item(), .tolist(), .cpu() or .numpy() in forward or loss_fn")
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    fix = "keep tensors on the device in forward and the loss; read values for logging outside the step"
    return check("host syncs", "warn", "; ".join(found[:3]) + more, fix)


def gpu_sync_check(model, batch, loss_fn, cfg):
    """On a GPU, a forward, loss and backward after a first one (the steady state: no lazy
    initialisation left), under torch.cuda.set_sync_debug_mode("warn"): every operation that
    makes the host wait for the GPU warns; each is named by the innermost line of the
    project's code that led to it (a sync in backward warns once backward is over: named as
    in backward)."""
    device, amp_dtype = torch.device("cuda"), AMP_DTYPES[cfg.amp]
    found = set()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return
        ours = [frame for frame in traceback.extract_stack()[:-1] if in_project(frame.filename)]
        found.add(f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "in backward")

    def step():
        with autocast("cuda", amp_dtype):
            loss = loss_fn(model(model_inputs(batch)), batch)
        loss.backward()

    try:
        previous = torch.cuda.get_sync_debug_mode()  # CUDA's first use: a GPU that cannot start raises
        model, batch = copy.deepcopy(model).to(device).train(), to_device(batch, device)
        step()
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    except Exception as error:  # out of memory on a small GPU, a CPU tensor made in forward...
        return check("host syncs on the GPU", "warn", f"not checked: a step raises {type(error).__name__}: "
                     f"{first_line(error, ERROR_LIMIT)}")  # fmt: skip
    if not found:
        return check("host syncs on the GPU", "pass", "a steady-state forward and backward never waits for the GPU")
    found = sorted(found)
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    fix = "keep tensors on the device in forward and the loss (no .item(), no Python branch on a tensor's value)"
    return check("host syncs on the GPU", "warn", f"the host waits for the GPU at {', '.join(found[:3])}{more}", fix)


def in_project(filename):
    """A file of the project's own (model.py, dataset.py, its tests), not the doctor, this
    package or torch."""
    path = Path(filename).resolve()
    installed = {".venv", "venv", "site-packages"} & set(path.parts)
    machinery = path.is_relative_to(PACKAGE) or path == PROJECT / "doctor.py"
    return path.is_relative_to(PROJECT) and not machinery and not installed
