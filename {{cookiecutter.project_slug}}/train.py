"""Train a model with PyTorch DistributedDataParallel, or fully sharded (--strategy fsdp).

The same script runs as one process or many:

    python train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2 --strategy fsdp

Read top to bottom: learning-rate schedule, the Trainer (setup, resume, loop, evaluation,
checkpoints), then `main`, which owns the process group's lifetime.
"""

import contextlib
import logging
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from config import parse_config, write_resolved_config
from contract import batch_size, load_task, model_inputs, to_device
from ddp_utils import (
    Agreement,
    CheckpointError,
    DeviceError,
    HostCopy,
    StopRequest,
    Watchdog,
    checkpoint_candidates,
    cleanup_distributed,
    is_collective_timeout,
    load_checkpoint,
    load_latest_checkpoint,
    rank_zero_only,
    set_tf32,
    setup_distributed,
    setup_logging,
    share_from_main,
    store_barrier,
    warn_main,
    write_stop_status,
)
from knobs import ConfigError
from loaders import build_loaders, mix_seed, seed_everything, start_epoch
from metrics import (
    Reporter,
    flops_per_sample,
    format_metrics,
    mfu,
    peak_memory_mb,
    peak_tflops,
    reset_peak_memory,
)
from profiling import StepProfiler
from strategy import AMP_DTYPES, build_optimizer, build_strategy, model_state_bytes, same_optimizer_implementation
from trackers import missing_package

log = logging.getLogger("train")


class TrainingError(RuntimeError):
    """An error every rank agrees on; reported once, without a traceback."""


class Preempted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ExitNow(Exception):
    """Ranks are out of step and the root cause is logged: exit without waiting for anyone."""


@dataclass(frozen=True)
class Plan:
    """The run's length and warmup in samples (all ranks together): the schedule's inputs."""

    total_samples: int
    warmup_samples: int


@dataclass
class Period:
    """Timing of the training since the last metrics line, which reports it."""

    started: float  # perf_counter()
    cpu_started: float  # process_time()
    samples_at_start: int
    data_wait_s: float = 0.0  # waiting for batches
    checkpoint_s: float = 0.0  # saving checkpoints (left out of throughput)
    window: tuple = None  # (time, samples trained, checkpoint_s) at the end of the period's first step

    def open_window(self, samples):
        # Throughput counts from the end of the period's first step: compile warm-up, worker
        # start-up and the first batches' latency stay out.
        if self.window is None:
            self.window = (time.perf_counter(), samples, self.checkpoint_s)

    def samples_per_s(self, samples, now):
        opened, samples_then, checkpoint_then = self.window or (self.started, self.samples_at_start, 0.0)
        if samples == samples_then:  # a single step: no window, the whole period
            opened, samples_then, checkpoint_then = self.started, self.samples_at_start, 0.0
        seconds = now - opened - (self.checkpoint_s - checkpoint_then)
        return (samples - samples_then) / seconds if seconds > 0 else 0.0


def lr_at(samples, cfg, plan):
    """Learning rate of the optimizer step that brings training to `samples` samples: linear
    warmup, then cosine or constant.

    A pure function of samples trained, not of steps: a run resumed with another world size,
    batch size or accumulation continues the same curve and still ends at the floor.
    """
    if samples < plan.warmup_samples:
        return cfg.lr * samples / plan.warmup_samples
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (samples - plan.warmup_samples) / max(1, plan.total_samples - plan.warmup_samples))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def rng_state():
    """This process's random generators, as checkpoint-safe data (tensors, numbers, lists)."""
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": numpy_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def numpy_state():
    _, key, position, has_gauss, cached_gaussian = np.random.get_state()
    return [key.tolist(), int(position), int(has_gauss), float(cached_gaussian)]  # plain data for weights_only


def set_rng_state(state):
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    key, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


@rank_zero_only
def report(message, *args, level=logging.INFO):
    log.log(level, message, *args)


class Trainer:
    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.task = load_task()  # model.py's and dataset.py's functions (contract.py)
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        # Only rank 0 imports the trackers' packages; a missing one stops every rank at once.
        self._agree("trackers_installed", rank_zero_only(missing_package)(cfg.trackers))
        self.train_loader, self.val_loader = build_loaders(cfg, ctx, *self._datasets())
        self.global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum_steps
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise TrainingError(
                f"--train_samples {cfg.train_samples} is less than one global batch "
                f"(batch_size x world_size x grad_accum_steps = {self.global_batch})"
            )
        planned_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.plan = Plan(
            total_samples=planned_steps * self.global_batch,  # the schedule spans the planned run
            warmup_samples=cfg.warmup_steps * self.global_batch,  # kept from the first start on resume
        )

        # The same generators on every rank while the model is built (strategy.py seeds torch
        # for the weights itself; this covers Python's and NumPy's too); afterwards each rank
        # gets its own stream for anything random it does.
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels once
            set_tf32(cfg.tf32)
        seed_everything(cfg.seed)
        try:
            self.strategy = build_strategy(cfg, ctx, self.task.build_model)
        except ConfigError as error:  # a setting that does not fit this world size, the same on every rank
            raise TrainingError(str(error)) from None
        self.model = self.strategy.model
        seed_everything(mix_seed(cfg.seed, ctx.rank))
        self.optimizer = build_optimizer(self.model, cfg, ctx.device)
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        # fp16 needs loss scaling; for bf16 and none the scaler is a no-op pass-through.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        # torch.compile goes around the DDP or FSDP wrapper, so their communication is compiled in
        # step with the graph (PyTorch's documented order); no_sync() still acts on the wrapper.
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        one_sample = self.train_loader.collate_fn([self.train_loader.dataset[0]])
        self.flops_per_sample = flops_per_sample(cfg, self.task, one_sample)
        self.tokens_per_sample = self.task.tokens_per_sample(cfg)  # predictions per sample
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
        self.peak_tflops = peak_tflops(device_name, cfg.amp, cfg.tf32, cfg.peak_tflops)
        self.reporter = Reporter(ctx, cfg, self.output_dir)
        self.profiler = StepProfiler(cfg, ctx.device, self.output_dir, before_toggle=self._finish_collectives)

        self.epoch = 0  # current epoch (0-based)
        self.step = 0  # optimizer steps done in the whole run
        self.samples_seen = 0  # samples trained in the whole run, all ranks: the schedule's clock
        self.batches_done = 0  # micro-batches done by each rank in the current epoch
        self.loss_totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # sum, count
        self.pending = None  # (step, Agreement) of the last optimizer step, read one step later
        self.pending_log = None  # (step, HostCopy of loss and gradient norm, lr, loss scale, samples/s)
        self.resumed = False  # from a checkpoint
        self.skipped_in_a_row = 0  # fp16 steps skipped for overflow, in a row
        self.last_evaluated = None  # the step of the last metrics line
        self.last_saved = None  # the step of the last checkpoint this process wrote
        self.period = Period(time.perf_counter(), time.process_time(), 0)  # restarted by train()
        self.stop = StopRequest()
        # Fires a little before the collective timeout, so stacks are written before the job ends.
        self.watchdog = Watchdog(cfg.timeout_seconds, ctx.rank, self.stop)

    def _datasets(self):
        """The task's datasets. A missing data folder is agreed by all ranks (it may be missing
        on one node only) and reported once, before anyone waits in a collective."""
        datasets, problem = None, None
        try:
            datasets = self.task.build_datasets(self.cfg)
        except ConfigError as error:
            problem = str(error)
        self._agree("datasets", problem)
        return datasets

    def _agree(self, name, problem):
        """Stop every rank with `problem` (None: no problem) if any rank has one: all ranks
        call this, and the error is reported once, before anyone waits in a collective."""
        problem = store_barrier(self.ctx, name, problem, self.cfg.timeout_seconds, "--timeout_seconds")
        if problem:
            raise TrainingError(problem)

    def write_config(self):
        """output_dir/config.toml, once the run is known to start (or resume): the config of its
        latest start, which `--config` reads back."""
        self._agree("config_written", rank_zero_only(write_resolved_config)(self.cfg, self.output_dir))

    def open_trackers(self):
        """Start the trackers' runs (rank 0), or continue them when training resumed."""
        self._agree("trackers_open", self.reporter.open_trackers(self.cfg, self.step if self.resumed else None))

    # --- resume ---------------------------------------------------------------------------

    def resume(self):
        cfg, ctx = self.cfg, self.ctx
        if cfg.resume == "none":
            if checkpoint_candidates(self.checkpoint_dir):
                raise TrainingError(
                    f"--resume none, but {self.checkpoint_dir} holds checkpoints of an earlier run: "
                    "pass --resume auto to continue it, or another --output_dir to start fresh"
                )
            return
        # Rank 0 chooses the file and every rank loads that one: ranks choosing on their own
        # could pick different files after a transient read error and silently diverge. The
        # choice and the outcome travel through the store: reading a large checkpoint from a
        # slow file system may take longer than --timeout_seconds.
        self.watchdog.beat("choosing the checkpoint to resume", seconds=cfg.checkpoint_timeout_seconds)
        path, error, state = self._choose_checkpoint() if ctx.is_main else (None, None, None)
        path, error = share_from_main(ctx, "resume_choice", [path, error], cfg.checkpoint_timeout_seconds)
        if error:
            raise CheckpointError(error)
        if path is None:
            return
        if state is None:
            try:
                state = load_checkpoint(Path(path))
            except CheckpointError as failure:
                error = str(failure)
        error = store_barrier(ctx, "resume_loaded", error, cfg.checkpoint_timeout_seconds)
        if error:
            raise CheckpointError(error)
        self.load_state(state, Path(path))

    def _choose_checkpoint(self):
        """(path or None, error or None, state or None), decided by rank 0 alone."""
        try:
            if self.cfg.resume == "auto":
                state, path = load_latest_checkpoint(self.checkpoint_dir, self.strategy.sharded)
                return (str(path) if path else None), None, state
            return self.cfg.resume, None, load_checkpoint(Path(self.cfg.resume))
        except CheckpointError as error:
            return None, str(error), None

    def load_state(self, state, path):
        saved = state["config"]
        mismatched = [
            f"--{name} is {getattr(self.cfg, name)}, the checkpoint's is {saved[name]}"
            for name in self.task.shape_fields
            if saved[name] != getattr(self.cfg, name)
        ]
        if mismatched:
            raise TrainingError(f"checkpoint {path} has another model shape: {', '.join(mismatched)}")
        with same_optimizer_implementation(self.optimizer):  # this machine's, not the saving one's
            self.strategy.load(state, path, self.optimizer)  # the model and optimizer state
        if self.scaler.is_enabled() and not state["scaler"]:
            report("checkpoint %s was trained without loss scaling (--amp %s): the fp16 loss scale starts afresh",
                   path, saved["amp"])  # fmt: skip
        else:
            self.scaler.load_state_dict(state["scaler"])  # a disabled scaler (bf16, none) ignores it
        self.epoch, self.step = state["epoch"], state["step"]
        self.samples_seen = state.get("samples_seen", self.step * self.global_batch)
        if "warmup_samples" in state and saved["warmup_steps"] == self.cfg.warmup_steps:
            self.plan = Plan(self.plan.total_samples, state["warmup_samples"])
        # The position in the epoch as samples of the one shuffled order, so it converts to
        # another world size, batch size or accumulation: to the nearest whole global batch.
        samples_done, world_size = state["samples_done"], self.ctx.world_size
        whole, rest = divmod(samples_done, self.global_batch)
        resume_at = min(whole + (2 * rest > self.global_batch), self.steps_per_epoch) * self.global_batch
        if resume_at != samples_done:
            change = f"{samples_done - resume_at} samples are trained twice" if resume_at < samples_done else (
                f"{resume_at - samples_done} samples are skipped"
            )  # fmt: skip
            warn_main(
                f"checkpoint {path} stopped {samples_done} samples into epoch {self.epoch + 1}, not a whole number "
                f"of global batches of {self.global_batch}: resuming at sample {resume_at}, so {change} this epoch"
            )
        self.batches_done = resume_at // (self.cfg.batch_size * world_size)
        ranks = state["ranks"]
        if len(ranks) == world_size:
            set_rng_state(ranks[self.ctx.rank]["rng"])
            self.loss_totals.copy_(ranks[self.ctx.rank]["loss_totals"])
        elif self.ctx.is_main:
            # Another world size: the data order continues unchanged (it depends on seed and
            # epoch only); per-rank generators restart and rank 0 carries the loss so far.
            self.loss_totals.copy_(sum(rank["loss_totals"] for rank in ranks))
        self.reporter.truncate(self.step)
        self.resumed = True
        report("resumed from %s: epoch %d, step %d", path, self.epoch + 1, self.step)

    # --- checkpoints ----------------------------------------------------------------------

    def _save_checkpoint(self, stopping=False):
        """Save where training is; returns whether all ranks agreed to stop (see settle).

        Per-rank state (random generators, partial loss sums) is gathered to rank 0, which
        writes it with the model and optimizer state (ddp) or beside their shards (fsdp); every
        rank calls this.
        """
        started = time.perf_counter()
        stop = self.settle()  # every step in this checkpoint was finite
        self.watchdog.beat(f"checkpoint at step {self.step}", seconds=self.cfg.checkpoint_timeout_seconds)
        ranks = [None] * self.ctx.world_size
        dist.all_gather_object(ranks, {"rng": rng_state(), "loss_totals": self.loss_totals.cpu()})
        state = {  # with the model and optimizer state the strategy adds (one file, or shards)
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "samples_seen": self.samples_seen,  # the learning rate is a pure function of it (lr_at)
            "warmup_samples": self.plan.warmup_samples,
            "batches_done": self.batches_done,  # micro-batches per rank, for people reading it
            "samples_done": self.batches_done * self.cfg.batch_size * self.ctx.world_size,  # for resuming
            "world_size": self.ctx.world_size,
            "ranks": ranks,
            "config": self.cfg.to_dict(),
        }
        self.strategy.save(state, self.optimizer, self.checkpoint_dir, self.cfg)
        self.last_saved = self.step
        if stop or stopping:  # the process exits next: an asynchronous save must be complete
            self.strategy.wait_for_checkpoint()
        self.period.checkpoint_s += time.perf_counter() - started
        return stop

    # --- training -------------------------------------------------------------------------

    def train(self):
        cfg = self.cfg
        if self._finished():
            report("run already complete: %d epochs, %d steps", self.epoch, self.step)
            return
        length = f"{cfg.max_steps} steps ({self.steps_per_epoch} an epoch)" if cfg.max_steps else (
            f"{cfg.epochs} epochs of {self.steps_per_epoch} steps"
        )  # fmt: skip
        report("training %s, global batch %d, %s", length, self.global_batch, self.strategy.name)
        self._start_period()
        while not self._finished():
            self._run_epoch()  # to the epoch's end, or to max_steps
            if self.settle():  # a stop agreed in the last step
                self._save_checkpoint(stopping=True)
                raise Preempted(self.stop.signum or signal.SIGTERM)
            if self.batches_done == self.steps_per_epoch * cfg.grad_accum_steps:  # the epoch is complete
                if not cfg.eval_every_steps:
                    self._evaluate_and_report()
                self.epoch, self.batches_done = self.epoch + 1, 0
                if self._save_checkpoint():
                    raise Preempted(self.stop.signum or signal.SIGTERM)
        if self.last_evaluated != self.step:  # the run ended between evaluations
            self._evaluate_and_report()
            if self.last_saved != self.step:  # not saved at the epoch's end already
                self._save_checkpoint()

    def _finished(self):
        return self.step >= self.cfg.max_steps if self.cfg.max_steps else self.epoch >= self.cfg.epochs

    def _run_epoch(self):
        """Train to the end of the epoch (or to max_steps), evaluating every eval_every_steps."""
        cfg, ctx = self.cfg, self.ctx
        accum = cfg.grad_accum_steps
        global_micro_batch = cfg.batch_size * ctx.world_size
        start_epoch(self.train_loader, self.epoch, ctx.rank, cfg.seed, start=self.batches_done * global_micro_batch)
        self.model.train()
        self.reporter.start_epoch(self.epoch + 1, cfg.epochs, self.steps_per_epoch, self.batches_done // accum)
        waiting_since = time.perf_counter()
        for micro_step, batch in enumerate(self.train_loader, start=self.batches_done):
            self.period.data_wait_s += time.perf_counter() - waiting_since
            self.watchdog.beat(f"training, optimizer step {self.step + 1}")
            self.profiler.at_step(self.step)  # --profile_steps
            last_micro_step = (micro_step + 1) % accum == 0
            loss = self.train_step(batch, sync=last_micro_step)
            if not last_micro_step:
                waiting_since = time.perf_counter()
                continue
            stop = self.optimizer_step()
            self.batches_done = micro_step + 1
            if stop:  # agreed by all ranks: save where we are and exit
                self._save_checkpoint(stopping=True)
                raise Preempted(self.stop.signum or signal.SIGTERM)
            self.period.open_window(self.samples_seen)
            self._log_step(loss)
            epoch_end = self.batches_done == self.steps_per_epoch * accum
            if cfg.eval_every_steps and self.step % cfg.eval_every_steps == 0:
                self._evaluate_and_report()
                save = not epoch_end  # the epoch's end saves anyway
            else:
                save = not epoch_end and cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0
            if save and self._save_checkpoint():
                raise Preempted(self.stop.signum or signal.SIGTERM)
            if cfg.max_steps and self.step >= cfg.max_steps:
                break
            waiting_since = time.perf_counter()
        self._log_step(None)  # the last step's line, if it is due
        self.reporter.end_epoch()

    def _start_period(self):
        """Start measuring what the next metrics line reports: time and memory from now (the
        loss sums restart after each line, and carry over in a checkpoint)."""
        reset_peak_memory(self.ctx.device)
        self.period = Period(time.perf_counter(), time.process_time(), self.samples_seen)

    def _evaluate_and_report(self):
        """Evaluate, write one metrics line (epoch and step) for the period since the last one."""
        self._log_step(None)  # the step's own loss line first
        period = self.period
        ended, cpu_seconds = time.perf_counter(), time.process_time() - period.cpu_started
        train_seconds = ended - period.started - period.checkpoint_s
        samples_per_s = period.samples_per_s(self.samples_seen, ended)
        metrics = {
            "epoch": self.epoch + 1,
            "step": self.step,
            "train_loss": self._reduce_train_loss(),
            **self.evaluate(),
            "samples_per_s": samples_per_s,  # steady state: no first step, no checkpoints
            "data_wait_s": period.data_wait_s,  # rank 0's time waiting for batches
            "compute_s": train_seconds - period.data_wait_s,  # the rest of the training time
            "cpu_s": cpu_seconds,  # rank 0's CPU time while training: host overhead shows here
            "peak_memory_mb": peak_memory_mb(self.ctx.device),  # rank 0's, since the last line
            "model_state_mb": model_state_bytes(self.model, self.optimizer) / 2**20,  # rank 0's share
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if self.tokens_per_sample > 1:  # sequences: each sample holds many predictions
            metrics["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        utilisation = mfu(self.flops_per_sample, samples_per_s, self.ctx.world_size, self.peak_tflops)
        if utilisation is not None:
            metrics["mfu"] = utilisation
        self.reporter.epoch_metrics(metrics)
        report("%s", format_metrics(metrics))
        self.last_evaluated = self.step
        self.loss_totals.zero_()
        self._start_period()

    def _log_step(self, loss):
        """Every log_every_steps steps, log the loss: copied now, printed a step later, when the
        copy is done, so the host never waits for the device. `loss=None` prints what is left."""
        if loss is not None:
            self.reporter.step()
        if self.pending_log is not None:
            step, copy, lr, scale, samples_per_s = self.pending_log
            loss_value, norm = copy.tolist()
            values = {"train_loss_step": loss_value, "lr": lr, "grad_norm": norm}
            if scale is not None:  # fp16: the loss scale that step used
                values["loss_scale"] = scale
            scale_text = "" if scale is None else f" loss_scale {scale:g}"
            report("step %d loss %.4f lr %.3g grad_norm %.3g%s", step, loss_value, lr, norm, scale_text)
            self.reporter.train_loss(step, values, samples_per_s)
            self.pending_log = None
        if loss is not None and self._log_due(self.step):
            samples_per_s = self.period.samples_per_s(self.samples_seen, time.perf_counter())
            lr = self.optimizer.param_groups[0]["lr"]
            norm, scale = self.step_norm_and_scale
            copy = HostCopy(torch.stack([loss.float(), norm.float()]))
            self.pending_log = (self.step, copy, lr, scale, samples_per_s)

    def _log_due(self, step):
        return self.cfg.log_every_steps and step % self.cfg.log_every_steps == 0

    def train_step(self, batch, sync):
        """Forward and backward of one micro-batch; returns its loss (detached). Gradients are
        all-reduced only when `sync` (the last micro-step of an optimizer step)."""
        batch = to_device(batch, self.ctx.device)
        with self.strategy.sync_gradients(sync):
            with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = self.task.loss_fn(self._forward(model_inputs(batch)), batch)
            self.scaler.scale(loss / self.cfg.grad_accum_steps).backward()
        loss = loss.detach()
        samples = batch_size(batch)
        self.loss_totals[0] += loss.double() * samples
        self.loss_totals[1] += samples
        return loss

    def _forward(self, inputs):
        try:
            return self.forward_model(inputs)
        except RuntimeError as error:
            # DDP notices parameters that got no gradient in the previous step only now, and
            # its message is long; say which knob fixes it.
            if "find_unused_parameters" not in str(error):
                raise
            raise TrainingError(
                "some model parameters received no gradient in the last step, so DDP could not finish "
                "its all-reduce: set --find_unused_parameters true (slower), or run with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL to see which parameters"
            ) from None

    def optimizer_step(self):
        """Clip, step and schedule, then act on the previous step's agreement (see settle).

        Returns whether all ranks agreed to stop. Every decision that ends or skips work is
        agreed by one small all-reduce per step, so no rank stops alone while the others wait
        in the next all-reduce. It runs while the next step is computed and is read one step
        later: the host never waits for the device. A stop therefore takes effect one or two
        optimizer steps after the signal; a non-finite step is caught one step later, before
        any checkpoint can hold it.
        """
        cfg, fp16 = self.cfg, self.scaler.is_enabled()
        norm = None
        if cfg.max_grad_norm > 0 or fp16 or self._log_due(self.step + 1):  # a log step reports the norm
            self.scaler.unscale_(self.optimizer)  # the true gradients: to clip, and to see fp16 overflow
            parameters = [p for p in self.model.parameters() if p.grad is not None]
            # With clipping off, an infinite limit leaves the gradients as they are and still
            # measures their global norm (over every shard under FSDP).
            norm = self.strategy.clip_gradients(parameters, cfg.max_grad_norm or math.inf)
        self.samples_seen += self.global_batch
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.samples_seen, cfg, self.plan)
        scale = self.scaler.get_scale() if fp16 else None  # fp16 syncs anyway: GradScaler.step reads found_inf
        self.scaler.step(self.optimizer)  # fp16: skipped when the gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.step_norm_and_scale = (norm, scale)
        low_scale = too_many_skips = False
        if fp16:
            new_scale = self.scaler.get_scale()
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if new_scale < scale else 0
            low_scale = new_scale < cfg.min_loss_scale
            too_many_skips = 0 < cfg.max_skipped_steps <= self.skipped_in_a_row
        grads_not_finite = ~torch.isfinite(norm) if norm is not None else False
        flags = (self.stop.requested, ~torch.isfinite(self.loss_totals[0]), grads_not_finite, low_scale, too_many_skips)
        previous, self.pending = self.pending, (self.step, Agreement(flags, self.ctx.device))
        return self._act_on(previous)

    def _finish_collectives(self):
        """Wait (locally, no new collective) until no collective of this rank is in flight: the
        profiler must not start or stop while one is. A gloo all-reduce started while
        recording ends on gloo's thread, after profiler.stop() has freed what it writes into:
        heap corruption, about 1 run in 6 when the step agreement was in flight."""
        if self.pending is not None:
            self.pending[1].wait()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    def settle(self):
        """Read the last step's agreement now (before a checkpoint or the epoch's end); returns
        whether all ranks agreed to stop."""
        previous, self.pending = self.pending, None
        return self._act_on(previous)

    def _act_on(self, pending):
        if pending is None:
            return False
        step, agreement = pending
        stop, loss_not_finite, grads_not_finite, low_scale, too_many_skips = agreement.result()
        fp16 = self.scaler.is_enabled()
        where = f"at optimizer step {step} (epoch {self.epoch + 1})"
        fixes = "lower --lr or set --max_grad_norm" + (", or train with --amp bf16" if fp16 else "")
        if loss_not_finite or (grads_not_finite and not fp16):  # fp16: an overflow skips the step
            raise TrainingError(f"loss or gradients are not finite {where}; {fixes}")
        if low_scale:
            raise TrainingError(
                f"the fp16 loss scale fell below --min_loss_scale {self.cfg.min_loss_scale:g} {where}: gradients "
                f"overflow at any scale; {fixes}"
            )
        if too_many_skips:
            raise TrainingError(
                f"{self.cfg.max_skipped_steps} optimizer steps in a row skipped for fp16 overflow, up to step "
                f"{step} (--max_skipped_steps); {fixes}"
            )
        return stop

    def _reduce_train_loss(self):
        totals = self.loss_totals.clone()
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """The task's metrics (model.py's evaluation_sums and evaluation_metrics) over exactly
        the whole validation set, on every rank: sums over every batch and rank, then divided,
        not an average of per-rank averages."""
        model = self.strategy.module  # not DDP's forward: nothing to synchronise in evaluation
        model.eval()
        names, totals, samples = None, None, 0
        for batch, counted in self._val_batches():
            self.watchdog.beat("evaluation")
            batch = to_device(batch, self.ctx.device)
            with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                output = model(model_inputs(batch))
            sums = self.task.evaluation_sums(output, batch)
            # A batch run only to keep the ranks' all-gathers in step counts nowhere.
            values = torch.stack([torch.as_tensor(v, device=self.ctx.device).double() for v in sums.values()])
            if totals is None:
                names, totals = list(sums), torch.zeros_like(values)
            if counted:
                totals += values
                samples += batch_size(batch)
        totals = torch.cat([totals, torch.tensor([samples], dtype=torch.float64, device=self.ctx.device)])
        dist.all_reduce(totals)  # sums and counts, not an average of per-rank averages
        model.train()
        *sums, samples = totals.tolist()
        metrics = self.task.evaluation_metrics(dict(zip(names, sums)))
        return {**{name: float(value) for name, value in metrics.items()}, "val_samples": int(samples)}

    def _val_batches(self):
        """This rank's validation batches, each with whether it counts. Under FSDP every forward
        all-gathers parameters, so every rank runs as many as the rank with the most (ranks may
        hold one sample more than others): the ones short of it repeat their last batch,
        counted nowhere. Every rank runs at least one: the sums' names come from it."""
        batches = torch.tensor([max(1, len(self.val_loader))], device=self.ctx.device)
        if self.strategy.sharded:
            dist.all_reduce(batches, op=dist.ReduceOp.MAX)
        batch = None
        for batch in self.val_loader:
            yield batch, True
        if batch is None:  # no validation sample at all on this rank: any input will do
            batch = self.val_loader.collate_fn([self.val_loader.dataset[0]])
        for _ in range(batches.item() - len(self.val_loader)):
            yield batch, False

    def close(self, status):
        """status: finished, preempted, failed (agreed by all ranks) or crashed."""
        self.watchdog.close()
        if status != "crashed":  # stopping waits for collectives in flight, maybe with a peer that is gone
            self.profiler.stop()
        self.reporter.close(status)
        self.strategy.close()
        # The loaders' workers end now, in order: each gets its stop message and exits at once.
        # Left to the garbage collector at exit, their queues may be gone first, and each
        # worker would be waited for in vain, 5 s apiece.
        self.train_loader = self.val_loader = None


def run(cfg, ctx):
    """Train; returns the exit code. Everything holding process-group work (DDP's reducer)
    is released when this returns, before the group is destroyed."""
    setup_logging(ctx, cfg.output_dir)
    trainer, status = None, "failed"
    try:
        trainer = Trainer(cfg, ctx)
        trainer.resume()
        trainer.write_config()
        trainer.open_trackers()
        trainer.train()
        trainer.strategy.wait_for_checkpoint()  # an asynchronous save complete before the exit
        status = "finished"
    except (TrainingError, CheckpointError) as error:
        report("%s", error, level=logging.ERROR)
        if trainer is not None:  # every rank is here (the error was agreed): finish a save in flight
            with contextlib.suppress(CheckpointError):
                trainer.strategy.wait_for_checkpoint()
        return 1
    except Preempted as stop:
        status = "preempted"
        report("stopped by %s at step %d; checkpoint saved, run the same command to resume", stop, trainer.step)
        write_stop_status(128 + stop.signum)
        return 128 + stop.signum
    except Exception as error:
        # The ranks are out of step. Log the root cause first, on this rank, with its
        # traceback: whatever comes after (destroying the process group) may block on a
        # peer that is gone.
        if is_collective_timeout(error):
            log.error(
                "rank %d: a collective timed out after --timeout_seconds %d during %s: another rank stalled or "
                "died (see the ranks' stacks above)",
                ctx.rank, cfg.timeout_seconds, trainer.watchdog.phase if trainer else "start-up",
            )  # fmt: skip
        else:
            log.error("rank %d failed", ctx.rank, exc_info=error)
        status = "crashed"  # the trackers are left as they are: closing one may wait on its server
        raise ExitNow from error
    finally:
        if trainer is not None:
            trainer.close(status)
    return 0


def main(argv=None):
    cfg = parse_config(argv)
    write_stop_status(None)  # a stop of an earlier (elastic) start is not this one's
    try:
        ctx = setup_distributed(cfg.timeout_seconds, trace_dir=Path(cfg.output_dir) / "nccl_trace", device=cfg.device)
    except DeviceError as error:
        # Each node finds this alone (a broken driver may be on one node only): its first
        # process says so, with the node's name.
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
            print(f"error: {socket.gethostname()}: {error}", file=sys.stderr)
        return 2
    try:
        code = run(cfg, ctx)
    except ExitNow:
        exit_now(1)
    cleanup_distributed()
    return code


def exit_now(code):
    """Exit at once, the logs flushed, without destroying the process group: after an error a
    peer may be gone, and waiting for it would hide nothing but could block forever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
