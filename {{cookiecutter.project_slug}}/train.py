"""Train a model with PyTorch DistributedDataParallel, or fully sharded (--strategy fsdp).

The same script runs as one process or many:

    python train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2 --strategy fsdp

Read top to bottom: the Trainer (setup, resume and save, the loop, a training step, the
metrics line), then `main`, which owns the process group's lifetime. The machinery it
orchestrates is in ddp_utils/ (its __init__.py is the map); model.py and dataset.py are the
task (ddp_utils/contract.py says what the loop reads from them).
"""

import math
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from config import parse_config, write_resolved_config
from ddp_utils.checkpoint import Checkpointer, resume_position
from ddp_utils.contract import batch_size, data_state, model_inputs, to_device
from ddp_utils.data import build_loaders, global_batch_size, mix_seed, seed_everything, start_epoch
from ddp_utils.dist import Agreement, DeviceError, agree, cleanup_distributed, set_tf32, setup_distributed
from ddp_utils.evaluation import Sampler, Validator
from ddp_utils.faults import ExitPath, Preempted, StepChecks, StopRequest, Watchdog, write_stop_status
from ddp_utils.inputs import check_inputs
from ddp_utils.knobs import InputError, print_error
from ddp_utils.logs import rank_zero_only, report, setup_logging, warn_main
from ddp_utils.metrics import Meter, Reporter, build_throughput
from ddp_utils.optim import build_optimizer
from ddp_utils.profiling import StepProfiler
from ddp_utils.schedule import Plan, lr_at
from ddp_utils.strategy import (
    AMP_DTYPES,
    build_strategy,
    load_full_weights,
    model_state_bytes,
    unused_parameters_named,
)


class Trainer:
    """One run: the loop, read top to bottom (`train`, `_run_epoch`, `train_step`,
    `optimizer_step`, `evaluate`). The components own their state and cadence: the strategy
    (ddp or fsdp), the Checkpointer, the Validator, the Meter, the StepProfiler, the Watchdog."""

    def __init__(self, cfg, ctx, task, datasets):
        self.cfg, self.ctx = cfg, ctx
        self.task = task  # model.py's and dataset.py's functions (ddp_utils/contract.py)
        self.output_dir = Path(cfg.output_dir)
        self.train_loader, self.val_loader = build_loaders(cfg, ctx, *datasets)
        self.global_batch = global_batch_size(cfg, ctx)
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps
        planned_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.plan = Plan(
            total_samples=planned_steps * self.global_batch,  # the schedule spans the planned run
            warmup_samples=cfg.warmup_steps * self.global_batch,  # kept from the first start on resume
        )

        # The same generators on every rank while the model is built (the strategy seeds torch
        # for the weights itself; this covers Python's and NumPy's too); afterwards each rank
        # gets its own stream for anything random it does.
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels once
            set_tf32(cfg.tf32)
        seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg, ctx, self.task.build_model)
        self.model = self.strategy.model
        self.parameters = list(self.model.parameters())  # listed once: the module tree is not walked per step
        seed_everything(mix_seed(cfg.seed, ctx.rank))
        self.optimizer = build_optimizer(self.model, cfg, ctx.device)
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        # fp16 needs loss scaling; for bf16 and none the scaler is a no-op pass-through.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        # torch.compile goes around the DDP or FSDP wrapper, so their communication is compiled in
        # step with the graph (PyTorch's documented order); no_sync() still acts on the wrapper.
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model

        self.epoch = 0  # current epoch (0-based)
        self.step = 0  # optimizer steps done in the whole run
        self.samples_seen = 0  # samples trained in the whole run, all ranks: the schedule's clock
        self.batches_done = 0  # micro-batches done by each rank in the current epoch
        self.loss_totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # sum, count
        self.loss_sum, self.loss_count = self.loss_totals.unbind()  # views: one in-place op each a step
        self.pending = None  # (step, Agreement) of the last optimizer step, read one step later
        self.resumed = False  # from a checkpoint
        self.last_evaluated = None  # the step of the last metrics line
        self.checks = StepChecks(cfg, fp16=self.scaler.is_enabled())
        self.stop = StopRequest()
        # Fires a little before the collective timeout, so stacks are written before the job ends.
        self.watchdog = Watchdog(cfg.timeout_seconds, ctx.rank, self.stop)
        self.checkpointer = Checkpointer(cfg, ctx, self.strategy, self.optimizer, self.scaler, self.watchdog,
                                         self.task.shape_fields, data_state(datasets[0]))  # fmt: skip

        self.validator = Validator(cfg, ctx, self.task, self.strategy, self.val_loader, self.watchdog, self.amp_dtype)
        one_sample = self.train_loader.collate_fn([self.train_loader.dataset[0]])  # for the FLOP count
        self.reporter = Reporter(ctx, cfg, self.output_dir)  # rank 0: metrics.jsonl, trackers, progress bar
        self.sampler = Sampler(cfg, ctx, self.task, self.strategy, self.reporter, self.amp_dtype)
        self.meter = Meter(cfg, ctx, self.reporter, build_throughput(cfg, ctx, self.task, one_sample))
        self.profiler = StepProfiler(cfg, ctx.device, self.output_dir, before_toggle=self._finish_collectives)

    def write_config(self):
        """output_dir/config.toml, once the run is known to start (or resume): the config of its
        latest start, which `--config` reads back."""
        problem = rank_zero_only(write_resolved_config)(self.cfg, self.output_dir)
        agree(self.ctx, "config_written", problem, self.cfg.timeout_seconds)

    def open_trackers(self):
        """Start the trackers' runs (rank 0), or continue them when training resumed."""
        problem = self.reporter.open_trackers(self.cfg, self.step if self.resumed else None)
        agree(self.ctx, "trackers_open", problem, self.cfg.timeout_seconds)

    def resume(self):
        """Continue from the checkpoint --resume names (the Checkpointer chooses and loads it)."""
        state, path = self.checkpointer.load()
        if state is None:  # a fresh start: from the task's pretrained weights, if any (--init_from)
            load_full_weights(self.strategy.module, self.task.pretrained_weights(self.cfg))
            return
        self.epoch, self.step = state["epoch"], state["step"]
        self.samples_seen = state.get("samples_seen", self.step * self.global_batch)
        if "warmup_samples" in state and state["config"]["warmup_steps"] == self.cfg.warmup_steps:
            self.plan = Plan(self.plan.total_samples, state["warmup_samples"])
        resume_at, warning = resume_position(state["samples_done"], self.global_batch, self.steps_per_epoch, self.epoch)
        if warning:
            warn_main(f"checkpoint {path} {warning}")
        self.batches_done = resume_at // (self.cfg.batch_size * self.ctx.world_size)
        self.checkpointer.restore_rank(state, self.loss_totals)
        self.reporter.truncate(self.step)
        self.resumed = True
        report("resumed from %s: epoch %d, step %d", path, self.epoch + 1, self.step)

    def save_checkpoint(self, stopping=False):
        """Save where training is; returns whether all ranks agreed to stop (see settle)."""
        started = time.perf_counter()
        stop = self.settle()  # every step in this checkpoint was finite
        progress = {
            "epoch": self.epoch,
            "step": self.step,
            "samples_seen": self.samples_seen,  # the learning rate is a pure function of it (lr_at)
            "warmup_samples": self.plan.warmup_samples,
            "batches_done": self.batches_done,  # micro-batches per rank, for people reading it
            "samples_done": self.batches_done * self.cfg.batch_size * self.ctx.world_size,  # for resuming
        }
        # The process exits after a stop: an asynchronous save must be complete.
        self.checkpointer.save(progress, self.loss_totals, stopping=stop or stopping)
        self.meter.saved_checkpoint(time.perf_counter() - started)
        return stop

    # --- the loop -------------------------------------------------------------------------

    def train(self):
        cfg = self.cfg
        if self._finished():
            report("run already complete: %d epochs, %d steps", self.epoch, self.step)
            return
        length = f"{cfg.max_steps} steps ({self.steps_per_epoch} an epoch)" if cfg.max_steps else (
            f"{cfg.epochs} epochs of {self.steps_per_epoch} steps"
        )  # fmt: skip
        report("training %s, global batch %d, %s", length, self.global_batch, self.strategy.name)
        self.meter.start_period(self.samples_seen)
        while not self._finished():
            self._run_epoch()  # to the epoch's end, or to max_steps
            if self.settle():  # a stop agreed in the last step
                self.save_checkpoint(stopping=True)
                raise self._preempted()
            if self.batches_done == self.steps_per_epoch * cfg.grad_accum_steps:  # the epoch is complete
                if not cfg.eval_every_steps:
                    self._evaluate_and_report()
                self.epoch, self.batches_done = self.epoch + 1, 0
                if self.save_checkpoint():
                    raise self._preempted()
        if self.last_evaluated != self.step:  # the run ended between evaluations
            self._evaluate_and_report()
            if self.checkpointer.last_saved != self.step:  # not saved at the epoch's end already
                self.save_checkpoint()

    def _preempted(self):
        """The exception that ends an agreed stop (its checkpoint saved): the signal this rank
        got, or SIGTERM on a rank that got none."""
        return Preempted(self.stop.signum or signal.SIGTERM)

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
            self.meter.waited_for_data(time.perf_counter() - waiting_since)
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
                self.save_checkpoint(stopping=True)
                raise self._preempted()
            lr = self.optimizer.param_groups[0]["lr"]
            self.meter.step_done(self.step, self.samples_seen, loss, *self.step_norm_and_scale, lr)
            self.sampler.at_step(self.step)  # --sample_every_steps
            epoch_end = self.batches_done == self.steps_per_epoch * accum
            if self.validator.should_validate(self.step):
                self._evaluate_and_report()
                save = not epoch_end  # the epoch's end saves anyway
            else:
                save = not epoch_end and cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0
            if save and self.save_checkpoint():
                raise self._preempted()
            if cfg.max_steps and self.step >= cfg.max_steps:
                break
            waiting_since = time.perf_counter()
        self.meter.end_epoch()

    def train_step(self, batch, sync):
        """Forward and backward of one micro-batch; returns its loss (detached). Gradients are
        all-reduced only when `sync` (the last micro-step of an optimizer step)."""
        batch = to_device(batch, self.ctx.device)
        with self.strategy.sync_gradients(sync):
            with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                with unused_parameters_named():  # DDP's long error, as the knob that fixes it
                    output = self.forward_model(model_inputs(batch))
                loss = self.task.loss_fn(output, batch)
            accum = self.cfg.grad_accum_steps
            self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        loss = loss.detach()
        samples = batch_size(batch)
        self.loss_sum.add_(loss, alpha=samples)
        self.loss_count.add_(samples)
        return loss

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
        if cfg.max_grad_norm > 0 or fp16 or self.meter.log_due(self.step + 1):  # a log step reports the norm
            self.scaler.unscale_(self.optimizer)  # the true gradients: to clip, and to see fp16 overflow
            parameters = [p for p in self.parameters if p.grad is not None]
            # With clipping off, an infinite limit leaves the gradients as they are and still
            # measures their global norm (over every shard under FSDP).
            norm = self.strategy.clip_gradients(parameters, cfg.max_grad_norm or math.inf)
        self.samples_seen += self.global_batch
        lr = lr_at(self.samples_seen, cfg, self.plan)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # fp16's loss scale before and after the step, kept on the device: get_scale() would
        # make the host wait for it, and nothing else here does (fused AdamW reads GradScaler's
        # found_inf on the device to skip an overflowed step).
        scale = loss_scale(self.scaler) if fp16 else None
        self.scaler.step(self.optimizer)  # fp16: skipped when the gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.step_norm_and_scale = (norm, scale)
        new_scale = loss_scale(self.scaler) if fp16 else None
        flags = self.checks.flags(self.stop.requested, self.loss_sum, norm, scale, new_scale)
        previous, self.pending = self.pending, (self.step, Agreement(flags, self.ctx.device))
        return self._act_on(previous)

    def settle(self):
        """Read the last step's agreement now (before a checkpoint or the epoch's end); returns
        whether all ranks agreed to stop."""
        previous, self.pending = self.pending, None
        return self._act_on(previous)

    def _act_on(self, pending):
        if pending is None:
            return False
        step, agreement = pending
        return self.checks.decide(agreement.result(), step, self.epoch)

    def _finish_collectives(self):
        """Wait (locally, no new collective) until no collective of this rank is in flight: the
        profiler must not start or stop while one is. A gloo all-reduce started while
        recording ends on gloo's thread, after profiler.stop() has freed what it writes into:
        heap corruption, about 1 run in 6 when the step agreement was in flight."""
        if self.pending is not None:
            self.pending[1].wait()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    # --- evaluation and the metrics line --------------------------------------------------

    def _evaluate_and_report(self):
        """Evaluate, write one metrics line (epoch and step) for the period since the last one."""
        timing = self.meter.end_period(self.samples_seen)
        train_loss = self.loss_totals.clone()
        dist.all_reduce(train_loss)
        metrics = {
            "epoch": self.epoch + 1,
            "step": self.step,
            "train_loss": (train_loss[0] / train_loss[1]).item(),
            **self.evaluate(),
            **timing,
            "model_state_mb": model_state_bytes(self.model, self.optimizer) / 2**20,  # rank 0's share
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        self.meter.write_line(metrics, self.samples_seen)
        self.last_evaluated = self.step
        self.loss_totals.zero_()  # the loss sums restart after each line (and carry over in a checkpoint)

    def evaluate(self):
        """The task's metrics over the whole validation set, the same on every rank."""
        return self.validator.evaluate()

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
        self.train_loader = self.val_loader = self.validator = None


def loss_scale(scaler):
    """GradScaler's current scale as a tensor on the device (a copy: update() changes it in place)."""
    return scaler._get_scale_async().clone()


def run(cfg, ctx):
    """Train; returns the exit code (ExitPath: how each failure ends). Everything holding
    process-group work (DDP's reducer) is released when this returns, before the group is
    destroyed. Bad data or settings raise InputError before output_dir is created."""
    task, datasets, notes = check_inputs(cfg, ctx)
    setup_logging(ctx, cfg.output_dir)
    for note in notes:
        warn_main(note)
    with ExitPath(ctx, cfg.timeout_seconds) as ending:
        trainer = ending.trainer = Trainer(cfg, ctx, task, datasets)
        trainer.resume()
        trainer.write_config()
        trainer.open_trackers()
        trainer.train()
        trainer.checkpointer.wait()  # an asynchronous save complete before the exit
    return ending.code


def main(argv=None):
    cfg = parse_config(argv)
    write_stop_status(None)  # a stop of an earlier (elastic) start is not this one's
    try:
        ctx = setup_distributed(cfg.timeout_seconds, trace_dir=Path(cfg.output_dir) / "nccl_trace", device=cfg.device)
    except DeviceError as error:
        error.report()  # once per node, with the node's name
        return 2
    try:
        code = run(cfg, ctx)  # a crash exits inside (faults.ExitPath), without destroying the group
    except InputError as error:  # agreed by every rank; nothing written yet
        print_error(str(error))
        code = 2
    cleanup_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
