"""Run the training (ddp_utils.train.trainer.main) of the task with one fault or instrument installed
(tests only).

    torchrun --nproc_per_node=2 tests/ddp_probe.py PROBE[,PROBE...] [train.py arguments]
    python tests/ddp_probe.py PROBE[,PROBE...] [train.py arguments]

Probes change nothing in the product code: they wrap its functions from the outside.
Rank 0 prints results as lines starting with "PROBE ".
"""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import task  # noqa: E402
from ddp_utils.distributed import faults
from ddp_utils.parallel import strategy
from ddp_utils.train import (
    run,
    trainer,  # noqa: E402
)

RANK = int(os.environ.get("RANK", 0))
LAST_RANK = int(os.environ.get("WORLD_SIZE", 1)) - 1


def training_call(loss):
    """Whether a loss comes from a training micro-step (not evaluation, not the FLOP count)."""
    return torch.is_grad_enabled() and loss.device.type != "meta"


def change_task(**hooks):
    """The task the run trains (task.TASK) with `hooks` replaced."""
    task.TASK = task.TASK.replace(**hooks)


def wrap_loss(wrapper):
    """Replace the task's training loss (its own loss_fn or the contract's default) with
    `wrapper(loss)`: whatever the loss."""
    change_task(loss_fn=wrapper(task.TASK.loss_fn))


def wrap_build_model(wrapper):
    """Replace the task's build_model with `wrapper(build_model)`."""
    change_task(build_model=wrapper(task.TASK.build_model))


class InfiniteGradient(torch.autograd.Function):
    """Identity forward; backward makes the gradient infinite, as an fp16 overflow would."""

    @staticmethod
    def forward(ctx, loss):
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def probe_print(**values):
    if RANK == 0:
        print("PROBE " + json.dumps(values), flush=True)


def count_allreduce():
    """Count gradient all-reduces with a DDP communication hook."""
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    class CountingDDP(strategy.DDP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_comm_hook(None, counting_hook)

    strategy.DDP = CountingDDP
    return lambda: probe_print(allreduce_calls=len(calls))


def change_training_loss(change):
    """Wrap the task's loss: each training micro-step's loss becomes `change(loss, call)`, with
    `call` this rank's count of them (1-based)."""
    calls = []

    def wrapper(original):
        def loss_fn(*args, **kwargs):
            loss = original(*args, **kwargs)
            if not training_call(loss):
                return loss
            calls.append(1)
            return change(loss, len(calls))

        return loss_fn

    wrap_loss(wrapper)


def nan_on_rank1():
    """Rank 1 alone gets a NaN loss (before backward) in its 3rd training micro-step."""
    change_training_loss(lambda loss, call: loss * float("nan") if RANK == 1 and call == 3 else loss)


def overflow_gradients(on_calls):
    """The last rank's gradients overflow (inf) in its training micro-steps `on_calls`
    (1-based); the loss itself stays finite. The all-reduce spreads the inf to every rank, as
    in real fp16."""
    change_training_loss(
        lambda loss, call: InfiniteGradient.apply(loss) if RANK == LAST_RANK and on_calls(call) else loss
    )


def overflow_once():
    """One overflowing step: the last rank's 3rd micro-step."""
    overflow_gradients(lambda call: call == 3)


def overflow_from_step3():
    """Every step overflows from the last rank's 3rd micro-step on (a diverged fp16 run)."""
    overflow_gradients(lambda call: call >= 3)


def fail_on_rank1():
    """Rank 1 alone raises an unexpected error in its 3rd micro-step; rank 0 goes on into the
    gradient all-reduce and finds its peer gone."""
    original = trainer.Trainer.train_step
    calls = []

    def run_batch(self, *args, **kwargs):
        calls.append(1)
        if RANK == 1 and len(calls) == 3:
            raise ValueError("injected failure on rank 1")
        return original(self, *args, **kwargs)

    trainer.Trainer.train_step = run_batch


def slow_loss():
    """Sleep 200 ms in each training micro-step's loss: a slow run that a test can join, signal
    or kill mid-way. It patches the task's loss, so it also works through tests/sitecustomize.py."""
    change_training_loss(lambda loss, call: time.sleep(0.2) or loss)


def slow_until_joined():
    """slow_loss, but 1 s a micro-step while the run has one process: a one-host run lasts
    (~100 s) until a second host joins, however slowly that host's torchrun starts on a busy
    machine; 200 ms a micro-step once it has."""
    seconds = 1.0 if int(os.environ.get("WORLD_SIZE", 1)) == 1 else 0.2
    change_training_loss(lambda loss, call: time.sleep(seconds) or loss)


def slow_until_released():
    """Sleep 200 ms in each training micro-step until the file $RELEASE_FILE exists, and with
    $HOLD_AT_CALL, stop at that micro-step until it does: a run that another run, started
    meanwhile, meets mid-way however long that one takes to start."""
    release = Path(os.environ["RELEASE_FILE"])
    hold = int(os.environ.get("HOLD_AT_CALL", 0))

    def wait(loss, call):
        if not release.exists():
            time.sleep(0.2)
        while call == hold and not release.exists():
            time.sleep(0.1)
        return loss

    change_training_loss(wait)


def fast_claim():
    """The folder claim renewed every 0.5 s and stale after 3 s (not 10 and 120 s): a test can
    stall a run past the staleness, and another job take its folder over, in seconds."""
    from ddp_utils.train import folder_claim

    folder_claim.BEAT_SECONDS, folder_claim.STALE_SECONDS = 0.5, 3


def slow_until_stopped():
    """Sleep 200 ms in each training micro-step until this process gets a stop signal (SIGTERM,
    SIGUSR1), on a first attempt only (not after torchrun's restart or SLURM's requeue): a run
    a test signals mid-way is still mid-way when the signal lands, however long a busy machine
    takes to pass it on. Works through tests/sitecustomize.py (faults.StopRequest is shared)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) or int(os.environ.get("SLURM_RESTART_COUNT", 0)):
        return
    signalled = []
    handle = faults.StopRequest._handle

    def record(self, signum, frame):
        signalled.append(signum)
        handle(self, signum, frame)

    faults.StopRequest._handle = record
    change_training_loss(lambda loss, call: loss if signalled else time.sleep(0.2) or loss)


def slow_checkpoint_write():
    """Rank 0 takes 35 s to write each checkpoint (a slow network file system): longer than
    torchrun's default 30 s grace after a signal, and than a short --timeout_seconds."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if RANK == 0 and str(getattr(f, "name", "")).endswith(".pt.tmp"):
            print("PROBE slow checkpoint write started", flush=True)
            time.sleep(35)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def stall_before_rename():
    """Rank 0 stops itself (SIGSTOP, its claim's heartbeat with it) once it has written its
    first checkpoint file, before the rename that puts it in place: a run stalled between the
    write and the rename, which a test continues (SIGCONT) after another run took its folder over."""
    original, writes = torch.save, []

    def save(obj, f, *args, **kwargs):
        result = original(obj, f, *args, **kwargs)
        if RANK == 0 and str(getattr(f, "name", "")).endswith(".pt.tmp") and not writes:
            writes.append(1)
            print("PROBE checkpoint written, not renamed: stalled", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return result

    torch.save = save


def hold_sharded_save():
    """Every rank holds in its save of the sharded checkpoint of step $HOLD_SAVE_STEP until the
    file $HOLD_SAVE_RELEASE exists (rank 0 prints a line as it starts holding): with
    $HOLD_SAVE_AT "write" (the default), in DCP's save, the temporary folder prepared and each
    rank past its fence; with "fence", before the ranks' fence. Each rank prints a line as it
    writes that checkpoint's shards."""
    import torch.distributed.checkpoint as dcp

    from ddp_utils.checkpoint import sharded

    name, release = f"step_{int(os.environ['HOLD_SAVE_STEP']):09d}", Path(os.environ["HOLD_SAVE_RELEASE"])
    at = os.environ.get("HOLD_SAVE_AT", "write")

    def hold():
        if RANK == 0:
            print(f"PROBE holding the save of {name}", flush=True)
        while not release.exists():
            time.sleep(0.1)

    def holding(original):
        def save(*args, checkpoint_id=None, **kwargs):
            if name in str(checkpoint_id):
                print(f"PROBE rank {RANK} writes the shards of {name}", flush=True)
                if at == "write":
                    hold()
            return original(*args, checkpoint_id=checkpoint_id, **kwargs)

        return save

    dcp.save, dcp.async_save = holding(dcp.save), holding(dcp.async_save)
    if at != "fence":
        return
    share = sharded.share_from_main

    def share_then_hold(ctx, key, value, timeout_seconds):
        shared = share(ctx, key, value, timeout_seconds)
        if key == f"sharded_tmp_{name}":  # rank 0's temporary folder is made
            hold()
        return shared

    sharded.share_from_main = share_then_hold


def slow_second_save():
    """On the first attempt only (not after torchrun's restart), rank 0 takes 60 s over its
    second checkpoint write, printing a line as it starts (the first is complete: there is one
    to resume from): the other rank waits for it at the checkpoint's barrier meanwhile, when a
    test kills a rank."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        return
    original, writes = torch.save, []

    def save(obj, f, *args, **kwargs):
        if RANK == 0 and str(getattr(f, "name", "")).endswith(".pt.tmp"):
            writes.append(1)
            if len(writes) == 2:
                print("PROBE second checkpoint write started", flush=True)
                time.sleep(60)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def out_of_memory():
    """Raise torch's own OutOfMemoryError on rank $OOM_RANK in optimizer step $OOM_STEP (the
    first of the run when 0), in phase $OOM_PHASE: batch (its move to the device), forward,
    backward, clipping (the gradients' unscaling and clipping), optimizer (its step), evaluation
    (the metrics line after that step), checkpoint (the save after it: inside the strategy's,
    where its gathers are), sampling (--sample_every_steps after it: the task's sample_text, or
    where it has none one that all-reduces, as a forward under fsdp all-gathers) or compile
    (the first call of what torch.compile returned). Prints each training call of the phase as
    it passes."""
    phase, rank, at_step = os.environ["OOM_PHASE"], int(os.environ["OOM_RANK"]), int(os.environ["OOM_STEP"])
    steps = []  # optimizer steps done on this rank

    def fail(where):
        if RANK == rank and len(steps) + 1 >= at_step and phase == where:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (probe, {where})")

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss):
            return loss.view_as(loss)

        @staticmethod
        def backward(ctx, grad):
            fail("backward")
            return grad

    def loss_wrapper(original):
        def loss_fn(output, batch):
            loss = original(output, batch)
            if training_call(loss):
                fail("forward")
                return Fail.apply(loss)
            if loss.device.type != "meta" and len(steps) + 1 > at_step:  # the evaluation after the step
                fail("evaluation")
            return loss

        return loss_fn

    wrap_loss(loss_wrapper)
    if phase == "evaluation":  # the task's evaluation sums, not its loss, may be what evaluation calls
        original_sums = task.TASK.evaluation_sums

        def evaluation_sums(output, batch):
            if len(steps) + 1 > at_step:
                fail("evaluation")
            return original_sums(output, batch)

        change_task(evaluation_sums=evaluation_sums)
    build = trainer.build_optimizer

    def build_optimizer(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        step = optimizer.step

        def counted_step(*step_args, **step_kwargs):
            fail("optimizer")
            result = step(*step_args, **step_kwargs)
            steps.append(1)
            return result

        optimizer.step = counted_step
        return optimizer

    trainer.build_optimizer = build_optimizer
    move = trainer.to_device

    def to_device(*args, **kwargs):
        fail("batch")
        return move(*args, **kwargs)

    trainer.to_device = to_device
    original_strategy = trainer.build_strategy

    def build_strategy(*args, **kwargs):
        built = original_strategy(*args, **kwargs)
        clip, save = built.clip_gradients, built.save

        def failing_clip(*clip_args, **clip_kwargs):
            fail("clipping")  # before the norm's all-reduce under fsdp: the peers are in it
            return clip(*clip_args, **clip_kwargs)

        def failing_save(*save_args, **save_kwargs):
            if len(steps) + 1 > at_step:
                fail("checkpoint")
            return save(*save_args, **save_kwargs)

        built.clip_gradients, built.save = failing_clip, failing_save
        return built

    trainer.build_strategy = build_strategy
    if phase == "sampling":
        original_sample = task.TASK.sample_text

        def sample_text(model, cfg, data):
            if len(steps) + 1 > at_step:
                fail("sampling")
            if original_sample is None:
                torch.distributed.all_reduce(torch.zeros(1))
                return "no text"
            return original_sample(model, cfg, data)

        change_task(sample_text=sample_text)
    if phase == "compile":

        def compile(model, *args, **kwargs):
            def first_call(*call_args, **call_kwargs):
                fail("compile")
                return model(*call_args, **call_kwargs)

            return first_call

        trainer.torch.compile = compile


def stop_on_rank1():
    """Rank 1 alone sees a stop request (as from SIGTERM) after its 3rd micro-step."""
    original = trainer.Trainer.train_step
    calls = []

    def run_batch(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        calls.append(1)
        if RANK == 1 and len(calls) == 3:
            self.stop.signum = 15
        return loss

    trainer.Trainer.train_step = run_batch


def unused_param():
    """The model has a layer that never gets a gradient."""

    class WithUnusedLayer(nn.Module):
        def __init__(self, used):
            super().__init__()
            self.used = used
            self.unused = nn.Linear(1, 1)

        def forward(self, inputs):
            return self.used(inputs)

    wrap_build_model(lambda build_model: lambda cfg: WithUnusedLayer(build_model(cfg)))


def item_in_forward():
    """The model's forward reads a value from its input (.item()), as Hugging Face's attention
    mask code does: it runs on real tensors, not on the meta device where FLOPs are counted."""

    class ReadsAValue(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            first = torch.utils._pytree.tree_leaves(inputs)[0]
            assert first.reshape(-1)[0].item() == first.reshape(-1)[0].item()  # a meta tensor has no value
            return self.inner(inputs)

    wrap_build_model(lambda build_model: lambda cfg: ReadsAValue(build_model(cfg)))


def eval_only():
    """Evaluate the resumed checkpoint instead of training."""

    def evaluate(self):
        probe_print(**self.evaluate())

    trainer.Trainer.train = evaluate


def on_clip(record):
    """Wrap the clipping both strategies call (ddp_utils.optim.optimizer.clip_grad_norm) so that
    `record(parameters, total_norm)` sees every call."""
    original = strategy.clip_grad_norm

    def clip_grad_norm(parameters, max_norm):
        parameters = list(parameters)
        norm = original(parameters, max_norm)
        record(parameters, norm)
        return norm

    strategy.clip_grad_norm = clip_grad_norm


def record_clip():
    """Print the gradient norm that clipping sees in the first step, and the norm after it."""
    calls = []

    def record(parameters, before):
        if not calls:
            after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters]))
            probe_print(before=before.item(), after=after.item())
        calls.append(1)

    on_clip(record)


def record_grad_norms():
    """Print the total gradient norm of every optimizer step (clipping computes it)."""
    norms = []
    on_clip(
        lambda parameters, norm: norms.append(
            norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
        )
    )
    return lambda: probe_print(grad_norms=norms)


def record_gradient_memory():
    """Print, over the micro-steps that do not end an optimizer step, the most gradient elements
    this process held afterwards, in parameter shards' units: its gradients (under fsdp, their
    local shards) and any unsharded gradient FSDP2 keeps aside to accumulate (1.0: a shard's
    worth; 2.0 on 2 processes: the whole model's)."""
    original = trainer.Trainer.train_step
    held = []

    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def train_step(self, batch, sync):
        loss = original(self, batch, sync)
        if not sync:
            grads = [local(p.grad) for p in self.parameters if p.grad is not None]
            for module in self.model.modules():
                if hasattr(module, "_get_fsdp_state"):  # an FSDP2 unit: what it accumulates unsharded
                    state = module._get_fsdp_state()
                    # torch 2.11 keeps one parameter group, later releases a list
                    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
                    for group in filter(None, groups):
                        for param in group.fsdp_params:
                            grads += [param.unsharded_accumulated_grad, getattr(param, "_unsharded_param", None)]
                            grads[-1] = grads[-1].grad if grads[-1] is not None else None
            elements = sum(grad.numel() for grad in grads if grad is not None)
            held.append(elements / sum(local(p).numel() for p in self.parameters))
        return loss

    trainer.Trainer.train_step = train_step
    return lambda: probe_print(gradient_memory=max(held, default=None))


def count_scale_reads():
    """Print how many times an optimizer step read fp16's loss scale to the host
    (GradScaler.get_scale, a wait for the GPU each time)."""
    original_step, original_get_scale = trainer.Trainer.optimizer_step, torch.amp.GradScaler.get_scale
    reads, inside = [0], [False]

    def optimizer_step(self):
        inside[0] = True
        try:
            return original_step(self)
        finally:
            inside[0] = False

    def get_scale(self):
        reads[0] += inside[0]
        return original_get_scale(self)

    trainer.Trainer.optimizer_step, torch.amp.GradScaler.get_scale = optimizer_step, get_scale
    return lambda: probe_print(scale_reads_in_steps=reads[0])


def slow():
    """Sleep 50 ms per micro-step, so a test can signal or kill processes mid-run."""
    original = trainer.Trainer.train_step

    def run_batch(self, *args, **kwargs):
        time.sleep(0.05)
        return original(self, *args, **kwargs)

    trainer.Trainer.train_step = run_batch


def crash_in_checkpoint_write():
    """The CRASH_AT_WRITE-th write of a checkpoint file (default 3), whatever its name (the
    numbered file, its temporary file, last.pt), dies halfway: SIGKILL, as on a node failure."""
    original = torch.save
    crash_at = int(os.environ.get("CRASH_AT_WRITE", 3))
    calls = []

    def save(obj, f, *args, **kwargs):
        name = str(getattr(f, "name", f))
        if name.endswith((".pt", ".pt.tmp")):  # checkpoint files, not in-memory pickles
            calls.append(name)
        if len(calls) == crash_at:
            with open(name, "wb") if isinstance(f, (str, Path)) else contextlib.nullcontext(f) as out:
                out.write(b"PK\x03\x04 half a checkpoint")
                out.flush()
                os.fsync(out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def with_dropout():
    """The model draws from the global random generator every step: dropout on its outputs."""
    wrap_build_model(lambda build_model: lambda cfg: nn.Sequential(build_model(cfg), nn.Dropout(0.2)))


def stall_rank1():
    """Rank 1 alone stops making progress (300 s) in its 3rd micro-step, as a stuck data read would."""
    original = trainer.Trainer.train_step
    calls = []

    def run_batch(self, *args, **kwargs):
        calls.append(1)
        if RANK == 1 and len(calls) == 3:
            time.sleep(300)
        return original(self, *args, **kwargs)

    trainer.Trainer.train_step = run_batch


def count_compressed_bytes():
    """Sum the bytes that gradient-compression hooks hand to all-reduce (bf16/fp16 tensors)."""
    original = torch.distributed.all_reduce
    sent = []

    def all_reduce(tensor, *args, **kwargs):
        if tensor.dtype in (torch.bfloat16, torch.float16):
            sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    torch.distributed.all_reduce = all_reduce
    return lambda: probe_print(compressed_bytes=sum(sent))


def record_initial_weights():
    """Rank 0 saves the whole model as training starts (gathered from the shards under fsdp)
    to <output_dir>/initial_weights.pt."""
    original = trainer.Trainer.resume

    def resume(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(self.strategy.module, options=StateDictOptions(full_state_dict=True))
        if RANK == 0:
            torch.save(weights, Path(self.cfg.output_dir) / "initial_weights.pt")
        return original(self)

    trainer.Trainer.resume = resume


def single_param_group():
    """The optimizer of earlier versions: AdamW with one group, weight decay on every parameter
    (checkpoints written this way must still resume)."""

    original = trainer.build_optimizer

    def build_optimizer(model, cfg, device, module=None):
        fused = original(model, cfg, device, module).defaults["fused"]  # this version's: only the groups differ
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)

    trainer.build_optimizer = build_optimizer


def record_staging():
    """Print, per asynchronous sharded save, the host buffers DCP's stager copied the shards into."""
    from torch.distributed.checkpoint.staging import DefaultStager

    original = DefaultStager.stage
    saves = []

    def stage(self, state_dict, **kwargs):
        staged = original(self, state_dict, **kwargs)
        tensors = [t for t in torch.utils._pytree.tree_leaves(staged) if isinstance(t, torch.Tensor)]
        saves.append(sorted(t.data_ptr() for t in tensors))
        return staged

    DefaultStager.stage = stage
    return lambda: probe_print(staging_buffers=saves)


def record_mesh():
    """Print rank 0's device-mesh groups under fsdp: the ranks and collective timeout of each."""
    original = trainer.Trainer.resume

    def resume(self):
        mesh = self.strategy.mesh
        groups = {}
        for name in mesh.mesh_dim_names or ():  # named dimensions: HSDP's
            group = mesh.get_group(name)
            timeout = group._get_backend(self.ctx.device).options._timeout
            groups[name] = {"ranks": torch.distributed.get_process_group_ranks(group), "timeout_s": timeout.seconds}
        probe_print(mesh=groups)
        return original(self)

    trainer.Trainer.resume = resume


def record_offload():
    """Print, over every FSDP2 unit (the root's included) once the model is built, how many
    units there are and each distinct (offloaded to the CPU, pinned) of their parameters."""
    original = trainer.Trainer.resume

    def resume(self):
        units, kinds = 0, set()
        for module in self.strategy.module.modules():
            if hasattr(module, "_get_fsdp_state"):
                units += 1
                state = module._get_fsdp_state()
                # torch 2.11 keeps one parameter group, later releases a list
                groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
                kinds |= {(param.offload_to_cpu, param.pin_memory) for group in filter(None, groups)
                          for param in group.fsdp_params}  # fmt: skip
        probe_print(offload={"units": units, "kinds": sorted(kinds)})
        return original(self)

    trainer.Trainer.resume = resume


def children_after_close():
    """Print how many child processes (DataLoader workers) are still running once the Trainer
    has closed, and how long closing took."""
    import multiprocessing

    original = trainer.Trainer.close

    def close(self, status):
        started = time.perf_counter()
        original(self, status)
        probe_print(children=len(multiprocessing.active_children()), close_s=time.perf_counter() - started)

    trainer.Trainer.close = close


def float64():
    """Compute in float64: the model (built under float64 as torch's default dtype) and every
    floating-point tensor of each item of the task's datasets. Comparisons of runs then check
    the distributed arithmetic itself, for any model: in float32, an optimizer such as AdamW
    turns rounding noise in near-zero gradients (an attention key bias, a BatchNorm bias) into
    whole steps that depend on the order of the sums."""
    torch.set_default_dtype(torch.float64)
    build_datasets = task.TASK.build_datasets
    change_task(build_datasets=lambda cfg: tuple(InFloat64(d) for d in build_datasets(cfg)))


class Wrapped(torch.utils.data.Dataset):
    """A dataset seen through a probe: anything it offers (set_epoch, data_state) passes
    through, but its dunder methods do not (its __getitems__ would bypass the wrapper's
    __getitem__)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]

    def __getattr__(self, name):
        if name == "data" or name.startswith("__"):  # data: not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.data, name)


class InFloat64(Wrapped):
    """A dataset's items with their floating-point tensors in float64."""

    def __getitem__(self, index):
        item = self.data[index]
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, item
        )


BAD_SAMPLES = {"training": {3, 10, 17}, "validation": {5}}


def bad_samples():
    """Samples 3, 10 and 17 of the training set and 5 of the validation set are bad, as a
    dataset's `check_samples` finds them (contract.py); each rank is asked about its share."""
    build_datasets = task.TASK.build_datasets

    def with_bad_samples(cfg):
        train, val = build_datasets(cfg)
        return WithBadSamples(train, BAD_SAMPLES["training"]), WithBadSamples(val, BAD_SAMPLES["validation"])

    change_task(build_datasets=with_bad_samples)


class WithBadSamples(Wrapped):
    def __init__(self, data, bad, keep=None):
        super().__init__(data)
        self.bad, self.keep = bad, list(range(len(data))) if keep is None else keep

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, index):
        return self.data[self.keep[index]]

    def check_samples(self, indices):
        return {i: f"sample {self.keep[i]} is bad (rank {RANK})" for i in indices if self.keep[i] in self.bad}

    def without(self, indices):
        dropped = set(indices)
        return WithBadSamples(self.data, self.bad, [k for i, k in enumerate(self.keep) if i not in dropped])


def count_orthogonalised():
    """Every rank prints, at the end, how many matrices it orthogonalised in each optimizer step
    (Muon's newton_schulz, wrapped): a rank's share of Muon's work."""
    from ddp_utils.optim import muon

    counts = []
    newton_schulz = muon.newton_schulz

    def counting(matrices, steps, *args, **kwargs):
        counts.append(len(matrices))
        return newton_schulz(matrices, steps, *args, **kwargs)

    muon.newton_schulz = counting
    step = muon.MuonWithAdamW.step

    def counting_step(self, *args, **kwargs):
        counts.append("step")
        return step(self, *args, **kwargs)

    muon.MuonWithAdamW.step = counting_step

    def finish():
        per_step, current = [], None
        for count in counts:
            if count == "step":
                current = 0
                per_step.append(current)
            else:
                per_step[-1] += count
        # One write of the whole line: the ranks share stdout, and a print may be split in two.
        line = "PROBE " + json.dumps({"rank": RANK, "orthogonalised_per_step": per_step}) + "\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())

    return finish


def record_group_lrs():
    """Rank 0 prints each optimizer step's learning rates, per parameter group (and whether the
    group is Muon's), as the step runs."""
    from ddp_utils.optim import muon

    seen = []
    for optimizer_class in (torch.optim.AdamW, muon.MuonWithAdamW):
        step = optimizer_class.step

        def recording_step(self, *args, _step=step, **kwargs):
            if not getattr(self, "_inner", False):
                seen.append([[group["lr"], bool(group.get("muon"))] for group in self.param_groups])
                if hasattr(self, "adamw"):
                    self.adamw._inner = True
            return _step(self, *args, **kwargs)

        optimizer_class.step = recording_step
    return lambda: probe_print(group_lrs=seen)


def record_full_collections():
    """Rank 0 prints how many full garbage collections (generation 2) ran during training
    outside the collector's own calls (collector.py: after checkpoints and evaluations), and
    how many it did. The model's loss keeps 20,000 new objects alive in each training
    micro-step, as a leaky cache would: under Python's own thresholds full collections follow."""
    import gc

    from ddp_utils.core import collector

    kept, state = [], {"training": False, "ours": False, "outside": 0, "by_collector": 0}

    def on_collection(phase, info):
        if phase == "start" and info["generation"] == 2 and state["training"]:
            state["by_collector" if state["ours"] else "outside"] += 1

    gc.callbacks.append(on_collection)

    def ours(method):
        def marked(self, *args, **kwargs):
            state["ours"] = True
            try:
                return method(self, *args, **kwargs)
            finally:
                state["ours"] = False

        return marked

    for name in ("start", "collect", "close"):
        setattr(collector.Collector, name, ours(getattr(collector.Collector, name)))
    train = trainer.Trainer.train

    def training(self):
        state["training"] = True
        try:
            return train(self)
        finally:
            state["training"] = False

    trainer.Trainer.train = training

    def leaky(loss, call):
        kept.append([[index] for index in range(20000)])
        return loss

    change_training_loss(leaky)
    return lambda: probe_print(full_collections_outside=state["outside"], by_collector=state["by_collector"])


def record_compiled_units():
    """Rank 0 prints, once the Trainer is built, whether the model it calls is compiled whole (a
    torch.compile wrapper) and how many of the shard units (strategy.shard_units, else the
    model) are compiled in place."""
    init = trainer.Trainer.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        units = strategy.shard_units(self.strategy.module) or [self.strategy.module]
        compiled = sum(getattr(unit, "_compiled_call_impl", None) is not None for unit in units)
        whole = isinstance(self.forward_model, torch._dynamo.eval_frame.OptimizedModule)
        probe_print(compiled_whole=whole, compiled_units=compiled, units=len(units))

    trainer.Trainer.__init__ = recording_init


def late_rank0():
    """Rank 0 starts 3 s after the others (a loaded machine): they reach any error first."""
    if RANK == 0:
        time.sleep(3)


PROBES = {
    f.__name__: f
    for f in (count_allreduce, nan_on_rank1, stop_on_rank1, unused_param, eval_only, record_clip, record_grad_norms)
    + (slow, crash_in_checkpoint_write, with_dropout, stall_rank1, count_compressed_bytes, overflow_once)
    + (overflow_from_step3, fail_on_rank1, slow_loss, slow_until_joined, slow_until_stopped, slow_until_released)
    + (slow_checkpoint_write, fast_claim, slow_second_save, out_of_memory, stall_before_rename, hold_sharded_save)
    + (record_initial_weights, single_param_group, record_staging, record_mesh, record_offload, children_after_close)
    + (float64,)
    + (bad_samples, late_rank0, record_gradient_memory, count_scale_reads, item_in_forward)
    + (count_orthogonalised, record_group_lrs, record_full_collections, record_compiled_units)
}

if __name__ == "__main__":
    finishes = [PROBES[name]() for name in sys.argv[1].split(",")]  # "a,b": both probes
    code = run.main(task.TASK, sys.argv[2:])
    for finish in finishes:
        if finish:
            finish()
    sys.exit(code)
