"""Check your own model and data on a laptop, before renting GPUs:

    python doctor.py [train.py flags]                    # on the CPU; no GPU needed
    python doctor.py --gpu_memory_gb 40 --nodes 4 --gpus_per_node 8 --batch_size 64

The model and data are built from the same config as training (config.py; model.py and
dataset.py through the task contract) and each check reports pass, warn or fail, with why and
the fix:

  1 vs 2 processes  in float64, a batch's gradients and buffers in this process against 2
              gloo processes under DDP (as training wraps the model) with half of it each: a
              batch norm without synchronisation or a loss that is not the mean per sample
              shows, named by the first parameter that differs (where the 2 processes cannot
              start, the same arithmetic in this process: the halves' gradients averaged, as
              DDP and accumulation make them)
  exact resume  two AdamW steps against one, a checkpoint's state loaded into a freshly built
              model, and the second: state kept outside parameters and buffers, or random
              numbers from a generator the model keeps, show
  data per rank  the training set as rank 0 and rank 1 of 2 build it (torchrun's variables,
              torch.distributed's answers): data chosen by rank shows
  shard units  the blocks --strategy fsdp shards one by one, and a module nothing initialises
              on the meta device (--init_on_meta)
  fsdp = ddp  one float64 AdamW step of the model under FSDP2 (a group of one process) against
              the plain model's: a parameter used outside the shard unit that holds it shows
  gradients   one float64 forward and backward on a few training samples: parameters that get
              no gradient (DDP then needs --find_unused_parameters), gradient entries that are
              zero in exact arithmetic (AdamW turns their float32 rounding noise into full
              steps), non-finite values
  memory      bytes per GPU of parameters, gradients, AdamW's state and activations (the peak
              of what a forward and the loss hold, saved for backward or not, measured on a few
              samples under --amp and taken to --batch_size) under ddp, fsdp over every GPU and
              hsdp at the job's world size; whether the configured --strategy fits
              --gpu_memory_gb, and what makes it fit
  host syncs  .item(), .tolist(), .cpu() and .numpy() in model.py's and dataset.py's forward
              and loss functions: each makes the host wait for the GPU every step. With a GPU,
              also a steady-state forward and backward under torch.cuda.set_sync_debug_mode

The 2 processes are the doctor's only ones, ended before it reports. Several optimizer steps
over real data loaders, sharding over several processes and the data position of a resume
are what the project's tests run on your model (tests/test_correctness.py, test_resilience.py,
test_fsdp.py).

The report prints as a table and is written to OUTPUT_DIR/doctor.json; the exit status is 1
when a check fails, 2 when the config or data is unusable.
"""

import ast
import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from config import parse_config
from ddp_utils.checkpoint import rng_state, set_rng_state
from ddp_utils.contract import batch_size, load_task, model_inputs, to_device
from ddp_utils.dist import DistContext
from ddp_utils.faults import TrainingError
from ddp_utils.knobs import ConfigError, InputError, OneLineParser, print_error
from ddp_utils.optim import build_optimizer
from ddp_utils.strategy import AMP_DTYPES, build_module, build_strategy, shard_units

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
    """The first two halves of equal size (an odd sample left out): two ranks' shares."""
    size = batch_size(batch) // 2
    return [
        tree_map_only(torch.Tensor, lambda t: t[:size], batch),
        tree_map_only(torch.Tensor, lambda t: t[size : 2 * size], batch),
    ]


def equivalence_check(model, batch, loss_fn):
    """In float64, the gradients of a batch on 1 process against its two halves on 2 processes
    (or 2 accumulation steps) agree to ~1e-10 when every sample counts alike. The model is in
    eval mode (dropout, however the model applies it, draws otherwise on other ranks) but for
    its batch norms without synchronisation, the difference sought; a synchronised one would
    need the processes, which the tests' 1-vs-2-process runs have."""
    shares = halves(batch)
    if batch_size(shares[0]) == 0:
        return check("1 vs 2 processes", "warn", "not checked: the training set has fewer than 2 samples")
    model.eval()
    for module in model.modules():
        synced = isinstance(module, nn.SyncBatchNorm) or getattr(module, "same_buffers_on_every_rank", False)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not synced:
            module.train()
    whole = tree_map_only(torch.Tensor, lambda t: t[: 2 * batch_size(shares[0])], batch)
    whole, split = gradients(model, [whole], loss_fn), gradients(model, shares, loss_fn)
    for name, grad in whole.items():
        scale = grad.abs().max().item() or 1.0
        if name not in split or (grad - split[name]).abs().max().item() > 1e-10 * scale:
            cause, fix = cause_of_difference(model)
            return check("1 vs 2 processes", "fail", f"{name}'s gradient differs: {cause}", fix)
    return check("1 vs 2 processes", "pass", "the gradients of a batch and of its halves agree to 1e-10 (float64)")


def processes_check(build_model, batch, loss_fn, cfg):
    """The real thing: 2 gloo processes, each with half of `batch` in the model as training
    wraps it (DDP, its buffer broadcast, synchronised batch norms really synchronising), and
    this process with all of it, in float64: one forward and backward each, the gradients
    DDP averaged and the buffers against this process's. As in equivalence_check, dropout is
    off (the models in eval mode but for their batch norms). The processes are spawned and
    gone when it returns (killed if they have not ended in PROCESSES_TIMEOUT s)."""
    shares = halves(batch)
    if batch_size(shares[0]) == 0:
        return check("1 vs 2 processes", "warn", "not checked: the training set has fewer than 2 samples")
    cfg = dataclasses.replace(cfg, strategy="ddp", amp="none", comm_hook="none", find_unused_parameters=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "path.json").write_text(json.dumps(sys.path))  # where this process finds the model's code
        with open(folder / "job.pkl", "wb") as job:
            pickle.dump((cfg, build_model, loss_fn, shares), job)
        processes = []
        try:
            for rank in (0, 1):
                with open(folder / f"rank{rank}.log", "w") as log:  # torch's own lines stay out of the report
                    processes.append(subprocess.Popen([sys.executable, "-c", RANK_MAIN, str(folder), str(rank)],
                                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
            deadline = time.monotonic() + PROCESSES_TIMEOUT
            while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in processes):
                    break  # one failed: the other would wait for it in a collective
                time.sleep(0.05)
        finally:
            for process in processes:
                process.kill()  # one that has exited is left as it is
                process.wait()
        errors = sorted(folder.glob("rank*.error"))
        if errors:
            why = errors[0].read_text()
            return check("1 vs 2 processes", "fail", f"under DDP, {errors[0].stem} raises {why}", "")
        if not (folder / "rank0.pt").exists():
            log = (folder / "rank0.log").read_text().strip().splitlines()
            why = f"not checked: the 2 processes did not finish ({log[-1] if log else f'{PROCESSES_TIMEOUT} s'})"
            return check("1 vs 2 processes", "warn", why[:300])
        split = torch.load(folder / "rank0.pt", weights_only=True)
    with generators_kept():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model = build_module(cfg, build_model, torch.device("cpu"), on_meta=cfg.init_on_meta)
            without_dropout(model)
            whole = tree_map_only(torch.Tensor, lambda t: t[: 2 * batch_size(shares[0])], batch)
            loss_fn(model(model_inputs(whole)), whole).backward()
        finally:
            torch.set_default_dtype(previous)
    compared = [("gradient", {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, "gradients"),
                ("buffer", dict(model.named_buffers()), "buffers")]  # fmt: skip
    for kind, expected, key in compared:
        for name, tensor in expected.items():
            got = split[key].get(name)
            scale = tensor.abs().max().item() or 1.0
            if got is None or (tensor - got).abs().max().item() > 1e-10 * scale:
                cause, fix = cause_of_difference(model)
                return check("1 vs 2 processes", "fail", f"{name}'s {kind} differs under DDP: {cause}", fix)
    return check("1 vs 2 processes", "pass", "2 gloo processes under DDP and 1 agree to 1e-10 (float64): gradients, "
                 "buffers")  # fmt: skip


PROCESSES_TIMEOUT = 120  # seconds for the 2 processes of processes_check: spawned, they import torch first


# The command of each of processes_check's 2 processes: the model's code found as this process
# finds it, then rank_gradients.
RANK_MAIN = "import json, sys; sys.path[:0] = json.load(open(sys.argv[1] + '/path.json')); import doctor; " \
            "doctor.rank_gradients(sys.argv[1], int(sys.argv[2]))"  # fmt: skip


def rank_gradients(folder, rank):
    """One of processes_check's 2 processes: its gradients (DDP's average) and buffers, from
    rank 0, to FOLDER/rank0.pt; what it raised to FOLDER/rank<N>.error."""
    folder = Path(folder)
    try:
        with open(folder / "job.pkl", "rb") as job:
            cfg, build_model, loss_fn, shares = pickle.load(job)
        torch.set_default_dtype(torch.float64)
        store = dist.FileStore(str(folder / "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        cpu = torch.device("cpu")
        context = DistContext(rank=rank, local_rank=rank, world_size=2, device=cpu, store=store, local_world_size=2)
        strategy = build_strategy(cfg, context, build_model)
        without_dropout(strategy.module)
        loss_fn(strategy.model(model_inputs(shares[rank])), shares[rank]).backward()
        if rank == 0:
            gradients = {n: p.grad for n, p in strategy.module.named_parameters() if p.grad is not None}
            torch.save({"gradients": gradients, "buffers": dict(strategy.module.named_buffers())},
                       folder / "rank0.pt.partial")  # fmt: skip
            (folder / "rank0.pt.partial").replace(folder / "rank0.pt")
        dist.destroy_process_group()
    except Exception as error:
        (folder / f"rank{rank}.error").write_text(f"{type(error).__name__}: {first_line(error)}")
        sys.exit(1)


def without_dropout(model):
    """Eval mode (dropout, however the model applies it, draws otherwise on other ranks) but
    for the batch norms, whose training-mode statistics are what differs between 1 process
    and 2."""
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()


def cause_of_difference(model):
    """The likely cause of a difference between 1 process and 2, and its fix."""
    batch_norm, synced = nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm
    norms = [name for name, module in model.named_modules()
             if isinstance(module, batch_norm) and module.training and not isinstance(module, synced)
             and not getattr(module, "same_buffers_on_every_rank", False)]  # fmt: skip
    if norms:
        fix = "nn.SyncBatchNorm.convert_sync_batchnorm(model) (or a norm per sample: LayerNorm, GroupNorm)"
        return f"{norms[0]} normalises each process's share with its own statistics", fix
    return ("the loss is not the mean over the batch's samples (a sum, or a mean over a count that differs between "
            "ranks), or the model draws or reads something that depends on the rank",
            "return the mean per sample from loss_fn: DDP averages the ranks' gradients")  # fmt: skip


def resume_check(build_model, batches, loss_fn, cfg):
    """Two optimizer steps, against one step, a checkpoint as train.py saves it (the model's
    state_dict, AdamW's, the random generators) loaded into a freshly built model, and the
    second step: bit for bit the same parameters, buffers, AdamW state and generators."""

    def start():
        torch.manual_seed(cfg.seed)  # as a new process builds it (train.py seeds), then its own stream
        model = build_model().double().train()
        return model, build_optimizer(model, cfg, torch.device("cpu"))

    def step(model, optimizer, batch):
        loss_fn(model(model_inputs(batch)), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with generators_kept() as before:  # torch's, Python's and NumPy's: each run starts from them
        model, optimizer = start()
        torch.manual_seed(STREAM)
        for batch in batches:
            step(model, optimizer, batch)
        expected = (model.state_dict(), optimizer.state_dict(), rng_state())
        set_rng_state(before)
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
        got = (resumed.state_dict(), optimizer.state_dict(), rng_state())
    names = {id(p): name for name, p in resumed.named_parameters()}
    return resume_row(expected, got, [names[id(p)] for group in optimizer.param_groups for p in group["params"]])


@contextlib.contextmanager
def generators_kept():
    """torch's, Python's and NumPy's random generators as they were, however the block ends."""
    before = rng_state()
    try:
        yield before
    finally:
        set_rng_state(before)


def resume_row(expected, got, names):
    """What differs between the uninterrupted run and the resumed one, (state_dict, optimizer
    state_dict, random generators) each, named: the first parameter or buffer, else AdamW's
    state of the first parameter (`names`, in the optimizer's order), else a generator."""
    fix = ("keep every state in parameters or buffers (register_buffer), and draw random numbers from torch's "
           "global generator (the checkpoint saves it), not from one the model keeps")  # fmt: skip
    (weights, adam, generators), (weights_got, adam_got, generators_got) = expected, got
    for name, tensor in weights.items():
        if not same(tensor, weights_got[name]):
            return check("exact resume", "fail", f"{name} differs after a resume", fix)
    for index, state in adam["state"].items():
        if not same(state, adam_got["state"].get(index)):
            return check("exact resume", "fail", f"AdamW's state of {names[index]} differs after a resume", fix)
    for name, state in generators.items():
        if not same(state, generators_got.get(name)):
            return check("exact resume", "fail", f"the {name} random generator's position differs after a resume",
                         "draw the same random numbers whatever the state the checkpoint does not hold")  # fmt: skip
    return check("exact resume", "pass", "a step after a save and load equals the uninterrupted step, bit for bit")


def as_rank(rank, world_size):
    """What a dataset sees of its process on rank `rank` of `world_size` (torchrun's variables,
    torch.distributed's answers), with no process group."""
    variables = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.dict(os.environ, {name: str(value) for name, value in variables.items()}))
    for name, value in (("is_initialized", True), ("get_rank", rank), ("get_world_size", world_size)):
        stack.enter_context(mock.patch.object(torch.distributed, name, lambda *args, value=value, **kwargs: value))
    return stack


def rank_data_check(task, cfg):
    """The training set rank 0 and rank 1 of 2 build, and the first, middle and last samples
    of each (drawn with the same random state): the same, as the DistributedSampler splits
    one dataset between the ranks."""
    built = []
    try:
        with generators_kept() as before:
            for rank in (0, 1):
                with as_rank(rank, 2):
                    set_rng_state(before)
                    train_set, _ = task.build_datasets(cfg)
                    indices = sorted({0, 1, len(train_set) // 2, len(train_set) - 1} & set(range(len(train_set))))
                    built.append((len(train_set), {i: train_set[i] for i in indices}))
    except Exception as error:  # a dataset that calls collectives (a barrier) needs the processes
        why = f"{type(error).__name__}: {first_line(error)}"
        return check("data per rank", "warn", f"not checked: building it as rank {len(built)} of 2 raised {why}")
    (size, samples), (other_size, others) = built
    fix = "build the same dataset on every rank: train.py's DistributedSampler gives each rank its share"
    if size != other_size:
        return check("data per rank", "fail", f"rank 0's training set has {size} samples, rank 1's {other_size}", fix)
    for index, sample in samples.items():
        if not same(sample, others[index]):
            return check("data per rank", "fail", f"training sample {index} differs between rank 0 and rank 1", fix)
    return check("data per rank", "pass", "ranks 0 and 1 of 2 build the same training set")


def same(a, b):
    """Bit for bit the same (NaN included), for tensors, arrays and what holds them."""
    (leaves, spec), (others, other_spec) = tree_flatten(a), tree_flatten(b)
    return spec == other_spec and all(map(same_leaf, leaves, others))


def same_leaf(x, y):
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        return x == y or (x != x and y != y)  # NaN
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))


def first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]


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


# --- memory ------------------------------------------------------------------------------------


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


def activation_trace(model, batch, loss_fn, amp_dtype):
    """The bytes a forward and the loss of `batch` hold after each operation: what they save
    for backward and what they hold for a while."""
    with LiveBytes() as tracked:
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(model_inputs(batch)), batch)
    del loss
    return tracked.trace


def activations_at(model, batch, loss_fn, cfg):
    """The peak activations of --batch_size samples. The bytes held after each operation are
    measured on the first half of `batch` and on the whole of it, and each is taken along
    the line through the two (what does not grow with the batch, such as autocast's copies of
    the weights, counted once): the peak is where the largest of them is at --batch_size,
    which need not be where it is for a few samples. Scaled from the whole when it has one
    sample or the operations differ with the batch's size."""
    amp_dtype, samples = AMP_DTYPES[cfg.amp], batch_size(batch)
    whole = activation_trace(model, batch, loss_fn, amp_dtype)
    half_samples = samples // 2
    half = tree_map_only(torch.Tensor, torch.clone, halves(batch)[0])  # its own storage, not the batch's
    half = activation_trace(model, half, loss_fn, amp_dtype) if half_samples else []
    if len(half) != len(whole):
        return max(whole, default=0) * cfg.batch_size / samples
    slopes = [(b - a) / (samples - half_samples) for a, b in zip(half, whole)]
    return max((b + slope * (cfg.batch_size - samples) for b, slope in zip(whole, slopes)), default=0.0)


def replicas(cfg, world_size, gpus_per_node):
    """The replicas --strategy fsdp keeps at this size (ddp_utils.strategy.hsdp_replicas)."""
    return cfg.replicate_degree or (world_size // gpus_per_node if gpus_per_node > 1 else 1)


def memory_plan(model, batch, loss_fn, cfg, world_size, gpus_per_node):
    """Bytes per GPU under ddp, fsdp over every GPU and hsdp (fsdp in replicas), and the flags
    of each: ({name: {part: bytes}}, {name: flags}, the configured one's name)."""
    parameters = list(model.parameters())  # bytes as built (float32, unless the model says otherwise)
    trainable = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in parameters) - trainable
    element = parameters[0].element_size() if parameters else 4
    compute = 2 if AMP_DTYPES[cfg.amp] is not None else element  # a parameter gathered for compute under fsdp
    activations = activations_at(model, batch, loss_fn, cfg)
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
    if cfg.strategy == "ddp":
        configured = "ddp"
    elif world_size % default:
        configured = None  # training refuses it (ddp_utils.strategy.hsdp_replicas)
    else:
        configured = "fsdp" if default == 1 else "hsdp" if "hsdp" in plans and hsdp == default else "ddp"
    return plans, flags, configured


def memory_check(plans, flags, configured, cfg, gpu_gb, world_size):
    gb = 1e9
    totals = {name: sum(plan.values()) / gb for name, plan in plans.items()}
    summary = ", ".join(f"{name} {total:.2f} GB" if total >= 0.1 else f"{name} {1000 * total:.1f} MB"
                        for name, total in totals.items())  # fmt: skip
    summary += f" per GPU at {world_size} GPUs, --batch_size {cfg.batch_size}, --amp {cfg.amp}"
    fits = {name: total <= 0.9 * gpu_gb for name, total in totals.items()}  # a tenth to fragmentation, the context
    if configured is None:
        why = f"--replicate_degree {cfg.replicate_degree} does not divide the {world_size} GPUs"
        return check("memory plan", "fail", f"{summary}: {why}", "a --replicate_degree that divides them")
    if fits[configured]:
        return check("memory plan", "pass", f"{summary}: {configured} fits {gpu_gb:g} GB")
    activations = plans[configured]["activations"] / gb
    fixes = [flags[name] for name in plans if fits[name]]
    if not fixes and totals[configured] - activations > 0.3 * totals[configured]:
        fixes.append("more GPUs with --strategy fsdp (the model state shards over them)")
    if activations > 0.3 * totals[configured]:
        if not getattr(cfg, "activation_checkpointing", True):
            fixes.append("--activation_checkpointing true")
        fixes.append(f"--batch_size {max(1, cfg.batch_size // 2)} --grad_accum_steps {2 * cfg.grad_accum_steps}")
    status = "warn" if any(fits.values()) else "fail"
    return check("memory plan", status, f"{summary}: {configured} does not fit {gpu_gb:g} GB", "; or ".join(fixes))


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


def fsdp_check(build_model, batch, loss_fn, cfg):
    """One AdamW step of the model as --strategy fsdp builds it (FSDP2 over a group of one
    process, this one: every parameter a DTensor that each unit's hooks gather) against the
    same step of the plain model, in float64: a parameter used outside the unit that holds
    it, or a step that differs, shows."""
    try:
        cfg = dataclasses.replace(cfg, strategy="fsdp", amp="none", replicate_degree=1, async_checkpoint=False)
    except ConfigError as error:
        return check("fsdp = ddp", "warn", f"not checked: {error}")
    if dist.is_initialized():
        return check("fsdp = ddp", "warn", "not checked: run the doctor as python doctor.py, not under torchrun")
    previous = torch.get_default_dtype()
    try:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    except Exception as error:
        return check("fsdp = ddp", "warn", f"not checked: gloo does not start here ({first_line(error)})")
    try:
        with generators_kept():
            torch.set_default_dtype(torch.float64)  # the models built in float64, as the tests' runs
            cpu = torch.device("cpu")
            plain = build_module(cfg, build_model, cpu, on_meta=cfg.init_on_meta)
            context = DistContext(rank=0, local_rank=0, world_size=1, device=cpu, store=store)
            sharded = build_strategy(cfg, context, build_model).model
            for model in (plain, sharded):
                torch.manual_seed(STREAM)  # the same dropout in both
                optimizer = build_optimizer(model, cfg, cpu)
                loss_fn(model(model_inputs(batch)), batch).backward()
                optimizer.step()
        for (name, expected), got in zip(plain.named_parameters(), sharded.parameters()):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            if (expected - got).abs().max().item() > 1e-10 * (expected.abs().max().item() or 1.0):
                return check("fsdp = ddp", "fail", f"{name} differs after a step under fsdp", FSDP_FIX)
    except (TrainingError, ConfigError) as error:  # a setting --strategy fsdp refuses: it names the flag
        return check("fsdp = ddp", "fail" if cfg.strategy == "fsdp" else "warn", f"--strategy fsdp refuses: {error}")
    except Exception as error:  # the model's own code under FSDP: whatever it raises is the finding
        why = f"a step under fsdp raises {type(error).__name__}: {first_line(error)}"
        return check("fsdp = ddp", "fail", why, FSDP_FIX)
    finally:
        torch.set_default_dtype(previous)
        dist.destroy_process_group()
    return check("fsdp = ddp", "pass", "a step under fsdp (FSDP2, one process) equals the plain step to 1e-10")


FSDP_FIX = ("use each parameter only in the forward of the shard unit that holds it (a weight shared between "
            "blocks belongs to the whole model: keep it out of shard_units())")  # fmt: skip


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


def gpu_sync_check(model, batch, loss_fn, cfg):
    """On a GPU, a forward, loss and backward after a first one (the steady state: no lazy
    initialisation left), under torch.cuda.set_sync_debug_mode("warn"): every operation that
    makes the host wait for the GPU warns; each is named by the innermost line of the
    project's code that led to it (a sync in backward warns once backward is over: named as
    in backward)."""
    device, amp_dtype = torch.device("cuda"), AMP_DTYPES[cfg.amp]
    found = set()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [frame for frame in traceback.extract_stack()[:-1] if in_project(frame.filename)]
        found.add(f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "in backward")

    def step():
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(model_inputs(batch)), batch)
        loss.backward()

    previous = torch.cuda.get_sync_debug_mode()
    try:
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
                     f"{first_line(error)}")  # fmt: skip
    if not found:
        return check("host syncs on the GPU", "pass", "a steady-state forward and backward never waits for the GPU")
    found = sorted(found)
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    fix = "keep tensors on the device in forward and the loss (no .item(), no Python branch on a tensor's value)"
    return check("host syncs on the GPU", "warn", f"the host waits for the GPU at {', '.join(found[:3])}{more}", fix)


def in_project(filename):
    """A file of the project's own (model.py, dataset.py, its tests), not the doctor or torch."""
    path = Path(filename).resolve()
    installed = {".venv", "venv", "site-packages"} & set(path.parts)
    return path.is_relative_to(PROJECT) and path != Path(__file__).resolve() and not installed


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
    plans, flags, configured = memory_plan(model, small, task.loss_fn, cfg, world_size, gpus_per_node)
    rows = [memory_check(plans, flags, configured, cfg, gpu_gb, world_size)]
    if torch.cuda.is_available():
        rows.append(gpu_sync_check(model, small, task.loss_fn, cfg))
    small = to_float64(small)  # the steps below on SAMPLES samples: a float64 step of a large model is slow
    processes = attempt("1 vs 2 processes", processes_check, task.build_model, small, task.loss_fn, cfg)
    if processes[0]["status"] == "warn":  # the processes could not run here: the same arithmetic in this one
        processes = attempt("1 vs 2 processes", equivalence_check, copy.deepcopy(model).double(), small, task.loss_fn)
        processes[0]["summary"] = f"in one process: {processes[0]['summary']}"
    rows += processes
    rows += attempt("exact resume", resume_check, lambda: built(task, cfg), halves(small), task.loss_fn, cfg)
    rows.append(rank_data_check(task, cfg))
    rows += attempt("shard units", sharding_check, task.build_model, model, cfg)
    rows.append(fsdp_check(task.build_model, small, task.loss_fn, cfg))
    rows += attempt("gradients", gradient_checks, model, batches, task.loss_fn, cfg)  # last: the model to float64
    rows.append(host_sync_check([PROJECT / "model.py", PROJECT / "dataset.py"]))
    return rows, plans


def attempt(name, run, *args):
    """The rows of `run(*args)`, or one that says what the model raised (in float64, say):
    the report goes on to the other checks."""
    try:
        rows = run(*args)
    except InputError:
        raise
    except Exception as error:
        return [check(name, "warn", f"not checked: it raises {type(error).__name__}: {first_line(error)}")]
    return rows if isinstance(rows, list) else [rows]


def table(rows):
    lines = ["| check | status | why | fix |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['status'].upper()} | {r['summary']} | {r['fix']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = OneLineParser(add_help=False)
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
    partial = out / "doctor.json.partial"  # never a half-written report
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(out / "doctor.json")
    print(f"\nwritten to {out / 'doctor.json'}")
    return 1 if any(row["status"] == "fail" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
