"""doctor.py's checks that the model trains the same however the job runs: 1 process against
2 in this one (doctor_processes.py runs the real processes), a step after a checkpoint's save
and load against the uninterrupted one, the data read after a resume, the training set each
rank builds, and a step under FSDP2 against the plain one. All in float64, where only a real
difference shows."""

import contextlib
import copy
import dataclasses
import os
from unittest import mock

import torch
from torch import distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from ..checkpoint.checkpointer import rng_state, set_rng_state
from ..contract import count_samples, model_inputs
from ..core.logs import first_line
from ..data.loaders import build_loaders, start_epoch
from ..distributed.process_group import DistContext
from ..errors import ConfigError, TrainingError
from ..optim.optimizer import build_optimizer
from ..parallel.model_init import build_module
from ..parallel.strategy import build_strategy
from .numerics import EXACT, FLOAT64_FIX, Tolerance, watching_casts
from .rows import ERROR_LIMIT, check, halves, same, whole

STREAM = 1234  # the random stream a rank draws from during training (any seed: the same in both runs)


def gradients(model, batches, loss_fn):
    """The gradients DDP (or accumulation) makes of `batches`, one per rank: each rank's mean
    loss backpropagated, the results averaged."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        (loss_fn(model(model_inputs(batch)), batch) / len(batches)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def equivalence_check(model, batch, loss_fn):
    """In float64, the gradients of a batch on 1 process against its two halves on 2 processes
    (or 2 accumulation steps) agree to ~1e-10 when every sample counts alike. The model is in
    eval mode (dropout, however the model applies it, draws otherwise on other ranks) but for
    its batch norms without synchronisation, the difference sought; a synchronised one would
    need the processes. In this one process: where processes_check cannot start its 2."""
    shares = halves(batch)
    if count_samples(shares[0]) == 0:
        return check("1 vs 2 processes", "warn", "not checked: the training set has fewer than 2 samples")
    model.eval()
    for module in model.modules():
        synced = isinstance(module, nn.SyncBatchNorm) or getattr(module, "same_buffers_on_every_rank", False)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not synced:
            module.train()
    full = tree_map_only(torch.Tensor, lambda t: t[: 2 * count_samples(shares[0])], batch)
    with watching_casts() as watch:
        full = gradients(model, [full], loss_fn)
    split, tolerance = gradients(model, shares, loss_fn), Tolerance.watched(model, watch)
    verdict, name = tolerance.compare(full, split)
    if verdict == "differs":
        cause, fix = cause_of_difference(model)
        return check("1 vs 2 processes", "fail", f"{name}'s gradient differs: {cause}", fix)
    if verdict == "close":
        return check("1 vs 2 processes", "warn", *tolerance.close_row("the gradients of a batch and of its halves"))
    return check("1 vs 2 processes", "pass", f"the gradients of a batch and of its halves agree to {EXACT:g} (float64)")


def without_dropout(model):
    """Eval mode (dropout, however the model applies it, draws otherwise on other ranks) but
    for the batch norms, whose training-mode statistics are what differs between 1 process
    and 2."""
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()


def cause_of_difference(model, batch=None):
    """The likely cause of a difference between 1 process and 2, and its fix: a batch norm
    without synchronisation, a forward that changes a parameter in place (run on `batch`, if
    given), else the loss or the rank."""
    batch_norm, synced = nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm
    norms = [name for name, module in model.named_modules()
             if isinstance(module, batch_norm) and module.training and not isinstance(module, synced)
             and not getattr(module, "same_buffers_on_every_rank", False)]  # fmt: skip
    if norms:
        fix = "nn.SyncBatchNorm.convert_sync_batchnorm(model) (GPUs only: DDP refuses it on the CPU), or GroupNorm"
        return f"{norms[0]} normalises each process's share with its own statistics", fix
    changed = changed_in_place(model, batch) if batch is not None else None
    if changed:
        return (f"the forward changes {changed} in place, each process from its own share (nn.Embedding's "
                "max_norm, say): the processes' copies drift apart",
                IN_PLACE_FIX)  # fmt: skip
    return ("the loss is not the mean over the batch's samples (a sum, or a mean over a count that differs between "
            "ranks), or the model draws or reads something that depends on the rank",
            "return the mean per sample from loss_fn: DDP averages the ranks' gradients")  # fmt: skip


IN_PLACE_FIX = "change parameters only through their gradients, or after optimizer steps"


def changed_in_place(model, batch):
    """The first parameter a forward of `model` on `batch` changes in place, or None."""
    versions = {name: p._version for name, p in model.named_parameters()}  # bumped by each in-place change
    with torch.no_grad():
        model(model_inputs(batch))
    return next((name for name, p in model.named_parameters() if p._version != versions[name]), None)


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
        why = f"{type(error).__name__}: {first_line(error, ERROR_LIMIT)}"
        return check("data per rank", "warn", f"not checked: building it as rank {len(built)} of 2 raised {why}")
    (size, samples), (other_size, others) = built
    fix = "build the same dataset on every rank: train.py's DistributedSampler gives each rank its share"
    if size != other_size:
        return check("data per rank", "fail", f"rank 0's training set has {size} samples, rank 1's {other_size}", fix)
    for index, sample in samples.items():
        if not same(sample, others[index]):
            return check("data per rank", "fail", f"training sample {index} differs between rank 0 and rank 1", fix)
    return check("data per rank", "pass", "ranks 0 and 1 of 2 build the same training set")


def data_position_check(task, cfg):
    """Training batch RESUMED_AT of epoch 1 on rank 0 of 2 (the loader as train.py builds it,
    with --num_workers and --persistent_workers), read as a run reads it, on from a batch of
    epoch 0, and read first after a resume there: a new dataset and loader, the random
    generators as the checkpoint restores them, the sampler started past the batches done.
    The same, or the resumed run trains on other data."""
    cfg = dataclasses.replace(cfg, batch_size=2, grad_accum_steps=1)
    ctx = DistContext(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), store=None, local_world_size=2)
    global_batch = cfg.batch_size * ctx.world_size
    iterators = []  # each ended (its workers) before the check returns

    def loader():
        train_set, val_set = task.build_datasets(cfg)
        if len(train_set) < (RESUMED_AT + 1) * global_batch:
            raise ValueError(f"the training set has fewer than {(RESUMED_AT + 1) * global_batch} samples")
        loaders = build_loaders(cfg, ctx, train_set, val_set)
        iterators.append(getattr(loaders[1], "_iterator", None))  # persistent validation workers
        return loaders

    def read(loaders, epoch, batches, start=0):
        """`batches` batches of `epoch` from the sampler's `start`, and the random generators
        after each (what a checkpoint after its step holds)."""
        start_epoch(loaders[0], epoch, ctx.rank, cfg.seed, start=start)
        iterators.append(iter(loaders[0]))
        got, states = [], []
        for _ in range(batches):
            got.append(next(iterators[-1]))
            states.append(rng_state())
        return got, states

    try:
        with generators_kept() as before, as_rank(0, 2):
            loaders = loader()
            read(loaders, 0, 1)
            straight, states = read(loaders, 1, RESUMED_AT + 1)
            set_rng_state(before)  # a new process
            loaders = loader()
            set_rng_state(states[RESUMED_AT - 1])  # the checkpoint's, restored after the build, as train.py does
            (resumed,), _ = read(loaders, 1, 1, start=RESUMED_AT * global_batch)
    except Exception as error:
        why = f"{type(error).__name__}: {first_line(error, ERROR_LIMIT)}"
        return check("data position", "warn", f"not checked: reading the training set as rank 0 of 2 raised {why}")
    finally:
        for iterator in iterators:
            getattr(iterator, "_shutdown_workers", lambda: None)()  # its workers end now
    if not same(straight[RESUMED_AT], resumed):
        workers = f" (--num_workers {cfg.num_workers})" if cfg.num_workers else ""
        why = (f"training batch {RESUMED_AT} of an epoch differs after a resume there{workers}: the dataset draws "
               "random numbers that depend on how far the loader has read, or keeps a count or an epoch of its "
               "own")  # fmt: skip
        fix = ("derive each sample's randomness from (seed, epoch, index) alone, with "
               "ddp_utils.data.loaders.mix_seed (an epoch set in the training process reaches persistent workers only "
               "through shared memory: the tasks' set_epoch)")  # fmt: skip
        return check("data position", "fail", why, fix)
    return check("data position", "pass", f"a resume at training batch {RESUMED_AT} of an epoch reads the same "
                 "next batch as the run that went on")  # fmt: skip


EPOCH, RESUMED_AT = 1, 2  # data_position_check's resume: the epoch (its second) and the batch


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
        return check("fsdp = ddp", "warn", f"not checked: gloo does not start here ({first_line(error, ERROR_LIMIT)})")
    watched, plain, running = [], None, None  # each step's casts; the plain model; the one stepping
    try:
        with generators_kept():
            torch.set_default_dtype(torch.float64)  # the models built in float64, as the tests' runs
            cpu = torch.device("cpu")
            plain = build_module(cfg, build_model, cpu, on_meta=cfg.init_on_meta)
            context = DistContext(rank=0, local_rank=0, world_size=1, device=cpu, store=store)
            sharded = build_strategy(cfg, context, build_model).model
            for model in (plain, sharded):
                running = model
                torch.manual_seed(STREAM)  # the same dropout in both
                optimizer = build_optimizer(model, cfg, cpu)
                with watching_casts() as watch:
                    loss_fn(model(model_inputs(batch)), batch).backward()
                optimizer.step()
                watched.append(watch)
        tolerance = Tolerance.watched(plain, watched[0])  # the plain model's precision
        noise = tolerance.noise({name: p.grad for name, p in plain.named_parameters() if p.grad is not None})
        expected = {name: p.detach() for name, p in plain.named_parameters()}
        got = {name: whole(p) for name, p in zip(expected, sharded.parameters())}
        verdict, name = tolerance.compare(expected, got, noise)
        if verdict == "differs":
            return check("fsdp = ddp", "fail", f"{name} differs after a step under fsdp", FSDP_FIX)
    except (TrainingError, ConfigError) as error:  # a setting --strategy fsdp refuses: it names the flag
        return check("fsdp = ddp", "fail" if cfg.strategy == "fsdp" else "warn", f"--strategy fsdp refuses: {error}")
    except Exception as error:  # the model's own code under FSDP: whatever it raises is the finding
        why = f"{type(error).__name__}: {first_line(error, ERROR_LIMIT)}"
        if running is not None and running is plain:  # the plain model's step raised: not about fsdp
            return check("fsdp = ddp", "warn", f"not checked: a float64 step of the model raises {why}", FLOAT64_FIX)
        return check("fsdp = ddp", "fail", f"a step under fsdp raises {why}", FSDP_FIX)
    finally:
        torch.set_default_dtype(previous)
        dist.destroy_process_group()
    if verdict == "close":
        return check("fsdp = ddp", "warn", *tolerance.close_row("a step under fsdp and the plain step"))
    return check("fsdp = ddp", "pass", f"a step under fsdp (FSDP2, one process) equals the plain step to {EXACT:g}")


FSDP_FIX = ("use each parameter only in the forward of the shard unit that holds it (a weight shared between "
            "blocks belongs to the whole model: keep it out of shard_units())")  # fmt: skip
