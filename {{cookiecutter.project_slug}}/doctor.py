"""Check your own model and data on a laptop, before renting GPUs:

    python doctor.py [train.py flags]                    # one process; no GPU needed
    python doctor.py --gpu_memory_gb 40 --nodes 4 --gpus_per_node 8 --batch_size 64

The model and data are built from the same config as training (config.py; model.py and
dataset.py through the task contract) and each check reports pass, warn or fail, with why and
the fix:

  1 vs 2 processes  in float64, a batch's gradients against those of its halves, averaged as
              DDP and accumulation do: a batch norm without synchronisation or a loss that is
              not the mean per sample shows, named by the first parameter that differs
  exact resume  two AdamW steps against one, a checkpoint's state loaded into a freshly built
              model, and the second: state kept outside parameters and buffers, or random
              numbers from a generator the model keeps, show
  gradients   one float64 forward and backward on a few training samples: parameters that get
              no gradient (DDP then needs --find_unused_parameters), gradient entries that are
              zero in exact arithmetic (AdamW turns their float32 rounding noise into full
              steps), non-finite values
  memory      bytes per GPU of parameters, gradients, AdamW's state and activations (what the
              forward saves for backward, measured on a few samples under --amp and scaled to
              --batch_size) under ddp, fsdp and hsdp at the job's world size; whether that fits
              --gpu_memory_gb, and what makes it fit
  host syncs  .item(), .tolist(), .cpu() and .numpy() in model.py's and dataset.py's forward
              and loss functions: each makes the host wait for the GPU every step

All in one process: data that depends on the rank, fsdp against ddp and the data position of a
resume need the processes; the project's tests run them on your model (tests/test_correctness.py,
test_resilience.py, test_fsdp.py).

The report prints as a table and is written to OUTPUT_DIR/doctor.json; the exit status is 1
when a check fails, 2 when the config or data is unusable.
"""

import argparse
import ast
import copy
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from config import parse_config
from ddp_utils.checkpoint import rng_state, set_rng_state
from ddp_utils.contract import batch_size, load_task, model_inputs
from ddp_utils.knobs import InputError, print_error
from ddp_utils.optim import build_optimizer
from ddp_utils.strategy import AMP_DTYPES, shard_units

PROJECT = Path(__file__).resolve().parent
NODES, GPUS_PER_NODE = {{ cookiecutter.num_nodes | int }}, {{ cookiecutter.gpus_per_node | int }}  # the job's size
SAMPLES = 4  # the activations, 1 vs 2 processes and the resume on this many training samples
GRADIENT_SAMPLES = 16  # each of the two batches of the gradient checks (a ReLU is dead on all 16 1 time in 65536)
HOST_SYNCS = ("item", "tolist", "cpu", "numpy")
TOLERANCE = 1e-9  # a float64 gradient entry this small against the largest is zero in exact arithmetic
STREAM = 1234  # the random stream a rank draws from during training (any seed: the same in both runs)


def check(name, status, summary, fix=""):
    return {"check": name, "status": status, "summary": summary, "fix": fix}


def to_float64(batch):
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, batch)


# --- 1 process against N, and a resume --------------------------------------------------------


def gradients(model, batches, loss_fn):
    """The gradients DDP (or accumulation) makes of `batches`, one per rank: each rank's mean
    loss backpropagated, the results averaged."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        (loss_fn(model(model_inputs(batch)), batch) / len(batches)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def halves(batch):
    size = batch_size(batch) // 2
    return [
        tree_map_only(torch.Tensor, lambda t: t[:size], batch),
        tree_map_only(torch.Tensor, lambda t: t[size:], batch),
    ]


def equivalence_check(model, batch, loss_fn):
    """In float64, the gradients of a batch on 1 process against its two halves on 2 processes
    (or 2 accumulation steps) agree to ~1e-10 when every sample counts alike. Dropout is off
    (other draws on other ranks), and a synchronised batch norm uses its running statistics: it
    needs the processes, which the tests' 1-vs-2-process runs have."""
    model.train()
    for module in model.modules():
        synced = isinstance(module, nn.SyncBatchNorm) or getattr(module, "same_buffers_on_every_rank", False)
        if isinstance(module, nn.modules.dropout._DropoutNd) or synced:
            module.eval()
    whole, split = gradients(model, [batch], loss_fn), gradients(model, halves(batch), loss_fn)
    for name, grad in whole.items():
        scale = grad.abs().max().item() or 1.0
        if name not in split or (grad - split[name]).abs().max().item() > 1e-10 * scale:
            batch_norm = nn.modules.batchnorm._BatchNorm
            norms = [n for n, m in model.named_modules() if isinstance(m, batch_norm) and m.training]
            cause, fix = (
                (f"{norms[0]} normalises each process's share with its own statistics",
                 "nn.SyncBatchNorm.convert_sync_batchnorm(model) (or a norm per sample: LayerNorm, GroupNorm)")
                if norms else
                ("the loss is not the mean over the batch's samples (a sum, or a mean over a count that differs "
                 "between ranks)", "return the mean per sample from loss_fn: DDP averages the ranks' gradients")
            )  # fmt: skip
            return check("1 vs 2 processes", "fail", f"{name}'s gradient differs: {cause}", fix)
    return check("1 vs 2 processes", "pass", "the gradients of a batch and of its halves agree to 1e-10 (float64)")


def resume_check(build_model, batches, loss_fn, cfg):
    """Two optimizer steps, against one step, a checkpoint as train.py saves it (the model's
    state_dict, AdamW's, the random generators) loaded into a freshly built model, and the
    second step: bit for bit the same parameters and buffers."""

    def start():
        torch.manual_seed(cfg.seed)  # as a new process builds it (train.py seeds), then its own stream
        model = build_model().double().train()
        return model, build_optimizer(model, cfg, torch.device("cpu"))

    def step(model, optimizer, batch):
        loss_fn(model(model_inputs(batch)), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with torch.random.fork_rng(devices=[]):
        model, optimizer = start()
        torch.manual_seed(STREAM)
        for batch in batches:
            step(model, optimizer, batch)
        stopped, optimizer = start()
        torch.manual_seed(STREAM)
        step(stopped, optimizer, batches[0])
        saved = copy.deepcopy({"model": stopped.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()})
        resumed, optimizer = start()
        torch.manual_seed(STREAM + 1)  # the new process's stream, until the checkpoint's is restored
        resumed.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved["rng"])
        step(resumed, optimizer, batches[1])
    expected, got = model.state_dict(), resumed.state_dict()
    for name, tensor in expected.items():
        if not torch.equal(tensor, got[name]):
            fix = ("keep every state in parameters or buffers (register_buffer), and draw random numbers from torch's "
                   "global generator (the checkpoint saves it), not from one the model keeps")  # fmt: skip
            return check("exact resume", "fail", f"{name} differs after a resume", fix)
    return check("exact resume", "pass", "a step after a save and load equals the uninterrupted step, bit for bit")


# --- gradients ---------------------------------------------------------------------------------


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
    if not unused:
        rows.append(check("unused parameters", "pass", f"all {len(named)} trainable parameters get a gradient"))
    else:
        status = "warn" if cfg.find_unused_parameters else "fail"
        rows.append(check("unused parameters", status, f"no gradient for {', '.join(unused[:3])}"
                          + (f" and {len(unused) - 3} more" if len(unused) > 3 else ""),
                          "use them in forward, freeze them (requires_grad=False), or set --find_unused_parameters "
                          "true (slower: DDP then searches the graph every step)"))  # fmt: skip
    rows.append(zero_gradient_check(model, named, other, loss_fn))
    return rows


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
        largest = max((p.grad.abs().max().item() for _, p in named), default=0.0)
        return {name: p.grad.abs() <= TOLERANCE * largest for name, p in named}, largest

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
        "such entries (an attention key bias: softmax ignores it) get float32 noise for a gradient, which AdamW "
        "scales to full steps: remove them, or keep them out of weight decay (biases are, in optim.py)",
    )  # fmt: skip


# --- memory ------------------------------------------------------------------------------------


def activation_bytes(model, batch, loss_fn, amp_dtype):
    """Bytes the forward saves for backward for `batch`, each storage once; the parameters it
    saves (a weight, for its gradient) are counted as parameters, not here."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            loss_fn(model(model_inputs(batch)), batch)
    return total


def memory_plan(model, batch, loss_fn, cfg, world_size, gpus_per_node):
    """Bytes per GPU under ddp, fsdp and hsdp: {strategy: {part: bytes}}."""
    parameters = list(model.parameters())  # bytes as built (float32, unless the model says otherwise)
    trainable = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in parameters) - trainable
    amp_dtype = AMP_DTYPES[cfg.amp]
    compute = 2 if amp_dtype is not None else 4  # bytes of a parameter gathered for compute under fsdp
    samples = len(model_inputs(batch))
    activations = activation_bytes(model, batch, loss_fn, amp_dtype) * cfg.batch_size / samples
    largest_unit = max((sum(p.numel() for p in unit.parameters()) for unit in shard_units(model)), default=0)
    element = parameters[0].element_size() if parameters else 4
    replicas = cfg.replicate_degree or (world_size // gpus_per_node if gpus_per_node > 1 else 1)
    plans = {}
    for name, shards in (("ddp", 1), ("fsdp", world_size), ("hsdp", world_size // max(1, replicas))):
        if name == "hsdp" and (shards in (1, world_size) or world_size % replicas):
            continue  # the same as ddp or fsdp here
        plans[name] = {
            "parameters": (trainable + frozen) / shards,
            "gradients": trainable / shards,
            "optimizer": 2 * trainable / shards,  # AdamW's two moments, as the parameters
            "activations": activations,
        }
        if shards > 1:  # a unit gathered for its forward or backward and the next one prefetched; one unit's gradients
            plans[name]["gathered"] = largest_unit * (2 * compute + element)
    return plans, activations


def memory_check(plans, activations, cfg, gpu_gb, world_size):
    gb = 1e9
    fits = {name: sum(plan.values()) / gb for name, plan in plans.items()}
    summary = ", ".join(f"{name} {total:.2f} GB" if total >= 0.1 else f"{name} {1000 * total:.1f} MB"
                        for name, total in fits.items())  # fmt: skip
    summary += f" per GPU at {world_size} GPUs, --batch_size {cfg.batch_size}, --amp {cfg.amp}"
    if fits["ddp"] <= 0.9 * gpu_gb:  # a tenth left to the allocator's fragmentation and the CUDA context
        return check("memory plan", "pass", f"{summary}: fits {gpu_gb:g} GB")
    state = fits["ddp"] - activations / gb
    fixes = []
    if any(total <= 0.9 * gpu_gb for name, total in fits.items() if name != "ddp"):
        fixes.append("--strategy fsdp" + (" (or hsdp: --replicate_degree)" if "hsdp" in fits else ""))
    elif state > 0.3 * fits["ddp"]:
        fixes.append("more GPUs with --strategy fsdp (the model state shards over them)")
    if activations / gb > 0.3 * fits["ddp"]:
        if not getattr(cfg, "activation_checkpointing", True):
            fixes.append("--activation_checkpointing true")
        fixes.append(f"--batch_size {max(1, cfg.batch_size // 2)} --grad_accum_steps {2 * cfg.grad_accum_steps}")
    status = "warn" if any(total <= 0.9 * gpu_gb for total in fits.values()) else "fail"
    return check("memory plan", status, f"{summary}: ddp does not fit {gpu_gb:g} GB", "; or ".join(fixes))


# --- host syncs --------------------------------------------------------------------------------


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


# --- the report --------------------------------------------------------------------------------


def build(cfg):
    """The task, its model as training builds it (torch seeded by --seed) and the first
    training samples: a batch of SAMPLES, and two batches of GRADIENT_SAMPLES (the same one
    twice when the training set is small)."""
    task = load_task()
    train_set, _ = task.build_datasets(cfg)
    if len(train_set) == 0:
        raise InputError("the training set is empty: nothing to check")
    small = next(iter(torch.utils.data.DataLoader(train_set, batch_size=min(SAMPLES, len(train_set)))))
    loader = iter(torch.utils.data.DataLoader(train_set, batch_size=min(GRADIENT_SAMPLES, len(train_set))))
    first = next(loader)
    second = next(loader, first) if len(train_set) >= 2 * GRADIENT_SAMPLES else first
    return task, built(task, cfg), small, (first, second)


def built(task, cfg):
    """The model as train.py builds it: torch seeded by --seed (the generators left as they were)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return task.build_model(cfg)


def diagnose(cfg, gpu_gb, world_size, gpus_per_node):
    task, model, small, batches = build(cfg)
    plans, activations = memory_plan(model, small, task.loss_fn, cfg, world_size, gpus_per_node)
    rows = [memory_check(plans, activations, cfg, gpu_gb, world_size)]
    small = to_float64(small)  # the steps below on SAMPLES samples: a float64 step of a large model is slow
    rows.append(equivalence_check(copy.deepcopy(model).double(), small, task.loss_fn))
    rows.append(resume_check(lambda: built(task, cfg), halves(small), task.loss_fn, cfg))
    rows += gradient_checks(model, batches, task.loss_fn, cfg)  # last: it turns the model to float64
    rows.append(host_sync_check([PROJECT / "model.py", PROJECT / "dataset.py"]))
    return rows, plans


def table(rows):
    lines = ["| check | status | why | fix |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['status'].upper()} | {r['summary']} | {r['fix']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0)
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--gpus_per_node", type=int, default=GPUS_PER_NODE)
    own, rest = parser.parse_known_args(argv)
    for name in ("gpu_memory_gb", "nodes", "gpus_per_node"):
        if not getattr(own, name) > 0:
            print_error(f"--{name} {getattr(own, name)}: must be positive")
            return 2
    cfg = parse_config(rest)
    try:
        rows, plans = diagnose(cfg, own.gpu_memory_gb, own.nodes * own.gpus_per_node, own.gpus_per_node)
    except InputError as error:
        print_error(str(error))
        return 2
    print(table(rows))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"checks": rows, "memory_bytes_per_gpu": plans, "gpu_memory_gb": own.gpu_memory_gb,
              "world_size": own.nodes * own.gpus_per_node}  # fmt: skip
    (out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out / 'doctor.json'}")
    return 1 if any(row["status"] == "fail" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
