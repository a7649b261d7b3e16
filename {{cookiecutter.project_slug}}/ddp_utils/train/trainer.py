"""The training loop: the Trainer, which run.py starts (train.py at the top of the project
hands it the task).

Read top to bottom: the Trainer's set-up, its progress as state (saved in every checkpoint),
the loop (`train`, `_run_epoch`, `train_step`, `optimizer_step`), then the metrics line. Each
component decides its own cadence: the Validator when to evaluate, the Checkpointer when to
save, the Meter when to log.
"""

import functools
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.checkpointer import Checkpointer, resume_position
from ..contract import count_samples, data_state, model_inputs, model_near_misses, to_device
from ..core.collector import Collector
from ..core.logs import report, warn_main
from ..core.precision import AMP_DTYPES, autocast, loss_scale
from ..data.loaders import build_loaders, global_batch_size, mix_seed, seed_everything, start_epoch
from ..distributed.collectives import Agreement
from ..distributed.device import set_tf32
from ..distributed.faults import StepChecks, StopRequest, Watchdog
from ..distributed.store_waits import agree
from ..errors import Preempted
from ..observe.flops import build_throughput
from ..observe.metrics import Meter, Reporter
from ..observe.profiling import StepProfiler
from ..optim.lr_schedule import Plan, lr_at
from ..optim.optimizer import build_optimizer, peak_lr
from ..parallel.activation_checkpointing import apply_activation_checkpointing, checkpointable_blocks
from ..parallel.strategy import build_strategy, load_full_weights, model_state_bytes, unused_parameters_named
from .evaluation import TextSamples, Validator
from .out_of_memory import MemoryGuard


class Trainer:
    """One run. Its components own their state: the strategy (ddp or fsdp, which holds the
    model), the Checkpointer, the Validator, the Meter, the StepProfiler, the Watchdog."""

    def __init__(self, cfg, ctx, task, datasets):
        self.cfg, self.ctx, self.task = cfg, ctx, task
        self.output_dir = Path(cfg.output_dir)
        self.train_loader, self.val_loader = build_loaders(cfg, ctx, *datasets)
        self.global_batch = global_batch_size(cfg, ctx)
        self.micro_steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps * cfg.grad_accum_steps
        self.steps_per_epoch = self.micro_steps_per_epoch // cfg.grad_accum_steps
        planned_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        # The schedule spans the planned run; its warmup is kept from the first start on resume.
        self.plan = Plan(total_samples=planned_steps * self.global_batch,
                         warmup_samples=cfg.warmup_steps * self.global_batch)  # fmt: skip

        if ctx.device.type == "cuda":
            # Fixed input shapes: cuDNN picks the fastest kernels once.
            torch.backends.cudnn.benchmark = True
            set_tf32(cfg.tf32)
        # The same generators on every rank while the model is built (the strategy seeds torch
        # for the weights itself; this covers Python's and NumPy's too); afterwards each rank
        # gets its own stream for anything random it does.
        seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg, ctx, task.build_model)
        self.model = self.strategy.model
        for problem in model_near_misses(self.strategy.module):
            warn_main(problem)
        # Listed once: the module tree is not walked every step.
        self.parameters = list(self.model.parameters())
        seed_everything(mix_seed(cfg.seed, ctx.rank))
        self.optimizer = build_optimizer(self.model, cfg, ctx.device, self.strategy.module)
        if cfg.optimizer == "muon":
            report("%s", self.optimizer.summary())
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        # fp16 needs loss scaling; for bf16 and none the scaler is a no-op pass-through.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        self.forward_model = self.strategy.forward_model  # compiled as the strategy decides (--compile)

        self.epoch = 0  # current epoch (0-based)
        self.step = 0  # optimizer steps done in the whole run
        self.samples_seen = 0  # samples trained in the whole run, all ranks: the schedule's clock
        self.batches_done = 0  # micro-batches done by each rank in the current epoch
        self.loss_totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # sum, count
        self.loss_sum, self.loss_count = self.loss_totals.unbind()  # views: one in-place op each
        self.last_norm = self.last_scale = None  # of the last optimizer step, for its loss line
        self.lrs = {}  # the learning rates of the last optimizer step ("lr", and "muon_lr" under Muon)
        self.resumed = False  # from a checkpoint
        self.last_evaluated = None  # the step of the last metrics line
        self.checks = StepChecks(cfg, fp16=self.scaler.is_enabled())
        # Out of memory: one line that says where and what helps (activation checkpointing where it can).
        self.memory = MemoryGuard(cfg, ctx, checkpointable=bool(checkpointable_blocks(self.strategy.module)))
        self.stop = StopRequest()
        # Fires a little before the collective timeout, so stacks are written before the job ends.
        self.watchdog = Watchdog(cfg.timeout_seconds, ctx.rank, self.stop)
        self.checkpointer = Checkpointer(cfg, ctx, self.strategy, self.optimizer, self.scaler, self.watchdog,
                                         task.shape_fields, data_state(datasets[0]))  # fmt: skip
        self.validator = Validator(cfg, ctx, task, self.strategy, self.val_loader, self.watchdog, self.amp_dtype)
        # rank 0: metrics.jsonl, trackers, progress bar
        self.reporter = Reporter(ctx, cfg, self.output_dir)
        self.samples = TextSamples(
            cfg, ctx, task, self.strategy, self.reporter, self.amp_dtype, data_state(datasets[0])
        )
        one_sample = self.train_loader.collate_fn([self.train_loader.dataset[0]])  # for the FLOP count
        checkpoint_blocks = functools.partial(apply_activation_checkpointing, mode=cfg.activation_checkpointing)
        self.meter = Meter(cfg, ctx, self.reporter, build_throughput(cfg, ctx, task, one_sample, checkpoint_blocks))
        self.profiler = StepProfiler(cfg, ctx.device, self.output_dir, before_toggle=self._finish_collectives)
        # Full garbage collections after checkpoints and evaluations, never inside a step.
        self.collector = Collector()

    # --- the trainer's progress: its own state in every checkpoint ------------------------

    def state_dict(self):
        return {
            "epoch": self.epoch,
            "step": self.step,
            # The learning rate is a pure function of it (lr_at).
            "samples_seen": self.samples_seen,
            "warmup_samples": self.plan.warmup_samples,
            # Micro-batches per rank, for people reading it; samples_done is what resuming reads.
            "batches_done": self.batches_done,
            "samples_done": self.batches_done * self.cfg.batch_size * self.ctx.world_size,
        }

    def load_state_dict(self, state, path):
        self.epoch, self.step = state["epoch"], state["step"]
        # Checkpoints of older versions of this project lack the schedule's clock.
        self.samples_seen = state.get("samples_seen", self.step * self.global_batch)
        if "warmup_samples" in state and state["config"]["warmup_steps"] == self.cfg.warmup_steps:
            self.plan = Plan(self.plan.total_samples, state["warmup_samples"])
        resume_at, warning = resume_position(state["samples_done"], self.global_batch, self.steps_per_epoch, self.epoch)
        if warning:
            warn_main(f"checkpoint {path} {warning}")
        self.batches_done = resume_at // (self.cfg.batch_size * self.ctx.world_size)

    def resume(self):
        """Continue from the checkpoint --resume names (the Checkpointer chooses and loads it)."""
        state, path = self.checkpointer.load()
        if state is not None:
            self.load_state_dict(state, path)
            self.checkpointer.restore_rank(state, self.loss_totals)
        # metrics.jsonl's lines after this step are redone: those of a run that stopped after its
        # last checkpoint, or before its first (a fresh start keeps none).
        agree(self.ctx, "metrics_truncated", self.reporter.truncate(self.step), self.cfg.timeout_seconds)
        if state is None:  # a fresh start: from the task's pretrained weights, if any (--init_from)
            load_full_weights(self.strategy.module, self.task.pretrained_weights(self.cfg))
            return
        self.resumed = True
        report("resumed from %s: epoch %d, step %d", path, self.epoch + 1, self.step)

    def checkpoint(self, stopping=False):
        """Save where training is, once every step in it is known to be finite (the last step's
        agreement is read first). The one stop path: when stopping, or when the agreement says
        all ranks stop, the run ends here with Preempted, its checkpoint complete."""
        started = time.perf_counter()
        stopping = self.read_agreement() or stopping
        # Its gathers (ddp: rank 0's whole state; fsdp: DCP's staging) may run out of memory.
        with self.memory.during("checkpoint", self.step):
            self.checkpointer.save(self.state_dict(), self.loss_totals, stopping=stopping)
        if not stopping:
            self.collector.collect()  # where the run waits anyway: its time counts as the checkpoint's
        self.meter.saved_checkpoint(time.perf_counter() - started)
        if stopping:
            # The signal this rank got, or SIGTERM on a rank that got none.
            raise Preempted(self.stop.signum or signal.SIGTERM)

    # --- the loop -------------------------------------------------------------------------

    def train(self):
        if self._finished():
            report("run already complete: %d epochs, %d steps", self.epoch, self.step)
            return
        # A disk too small for the kept checkpoints stops the run now, not at its first save.
        self.checkpointer.check_space(self.state_dict(), self.loss_totals)
        cfg, per_epoch = self.cfg, self.steps_per_epoch
        if cfg.max_steps:
            length = f"{cfg.max_steps} steps ({per_epoch} an epoch)"
        else:
            length = f"{cfg.epochs} epochs of {per_epoch} steps"
        report("training %s, global batch %d, %s", length, self.global_batch, self.strategy.name)
        self.collector.start()
        self.meter.start_period(self.samples_seen)
        while not self._finished():
            self._run_epoch()  # to the epoch's end, or to max_steps
            if self.read_agreement():  # a stop agreed in the last step
                self.checkpoint(stopping=True)
            if self.batches_done == self.micro_steps_per_epoch:  # the epoch is complete
                if not cfg.eval_every_steps:
                    self._evaluate_and_report()
                self.epoch, self.batches_done = self.epoch + 1, 0
                self.checkpoint()
        if self.last_evaluated != self.step:  # the run ended between evaluations
            self._evaluate_and_report()
            if self.checkpointer.last_saved != self.step:  # not saved at the epoch's end already
                self.checkpoint()

    def _finished(self):
        return self.step >= self.cfg.max_steps if self.cfg.max_steps else self.epoch >= self.cfg.epochs

    def _run_epoch(self):
        """Train to the end of the epoch (or to max_steps), evaluating every eval_every_steps."""
        cfg, ctx = self.cfg, self.ctx
        start = self.batches_done * cfg.batch_size * ctx.world_size
        start_epoch(self.train_loader, self.epoch, ctx.rank, cfg.seed, start=start)
        self.model.train()
        self.reporter.start_epoch(
            self.epoch + 1, cfg.epochs, self.steps_per_epoch, self.batches_done // cfg.grad_accum_steps
        )
        waiting_since = time.perf_counter()
        for micro_step, batch in enumerate(self.train_loader, start=self.batches_done):
            self.meter.waited_for_data(time.perf_counter() - waiting_since)
            self.watchdog.beat(f"training, optimizer step {self.step + 1}")
            self.profiler.at_step(self.step)  # --profile_steps
            last_micro_step = (micro_step + 1) % cfg.grad_accum_steps == 0
            loss = self.train_step(batch, sync=last_micro_step)
            if last_micro_step:
                stop = self.optimizer_step()
                self.batches_done = micro_step + 1
                if stop:  # agreed by all ranks: save where we are and exit
                    self.checkpoint(stopping=True)
                lr = self.lrs.get("lr", self.lrs.get("muon_lr"))
                self.meter.step_done(self.step, self.samples_seen, loss, self.last_norm, self.last_scale, lr)
                with self.memory.during("text sampling (--sample_every_steps)", self.step):
                    self.samples.at_step(self.step)
                self._evaluate_or_save()
                if cfg.max_steps and self.step >= cfg.max_steps:
                    break
            waiting_since = time.perf_counter()
        self.meter.end_epoch()

    def _evaluate_or_save(self):
        """After an optimizer step: a metrics line when the Validator says so, and a checkpoint
        after it or every --checkpoint_every_steps (the epoch's end saves anyway)."""
        if self.validator.should_validate(self.step):
            self._evaluate_and_report()
            due = True
        else:
            due = self.checkpointer.due(self.step)
        if due and self.batches_done != self.micro_steps_per_epoch:
            self.checkpoint()

    def train_step(self, batch, sync):
        """Forward and backward of one micro-batch; returns its loss (detached). Gradients are
        all-reduced only when `sync` (the last micro-step of an optimizer step)."""
        with self.memory.during("batch's move to the device", self.step + 1):
            batch = to_device(batch, self.ctx.device)
        with self.strategy.sync_gradients(sync):
            with self.memory.during("forward", self.step + 1), autocast(self.ctx.device, self.amp_dtype):
                # DDP's long error about unused parameters, as the knob that fixes it.
                with unused_parameters_named():
                    output = self.forward_model(model_inputs(batch))
                loss = self.task.loss_fn(output, batch)
            accum = self.cfg.grad_accum_steps
            with self.memory.during("backward", self.step + 1):
                self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        loss = loss.detach()
        samples = count_samples(batch)
        self.loss_sum.add_(loss, alpha=samples)
        self.loss_count.add_(samples)
        return loss

    def optimizer_step(self):
        """Clip, step and schedule; start this step's agreement with the other ranks and act on
        the previous one's (faults.StepChecks): returns whether all ranks agreed to stop."""
        cfg, fp16 = self.cfg, self.scaler.is_enabled()
        norm = None
        # A log step reports the norm.
        if cfg.max_grad_norm > 0 or fp16 or self.meter.log_due(self.step + 1):
            with self.memory.during("gradient clipping", self.step + 1):
                # The true gradients: to clip, and to see an fp16 overflow.
                self.scaler.unscale_(self.optimizer)
                parameters = [p for p in self.parameters if p.grad is not None]
                # With clipping off, an infinite limit leaves the gradients as they are and still
                # measures their global norm (over every shard under FSDP).
                norm = self.strategy.clip_gradients(parameters, cfg.max_grad_norm or math.inf)
        self.samples_seen += self.global_batch
        for group in self.optimizer.param_groups:  # AdamW's at --lr, Muon's at --muon_lr
            group["lr"] = lr_at(self.samples_seen, cfg, self.plan, peak_lr(group, cfg))
            self.lrs["muon_lr" if group.get("muon") else "lr"] = group["lr"]  # logged as the step used them
        # fp16's loss scale before and after the step, kept on the device: get_scale() would
        # make the host wait for it, and nothing else here does (fused AdamW reads GradScaler's
        # found_inf on the device to skip an overflowed step).
        scale = loss_scale(self.scaler) if fp16 else None
        with self.memory.during("optimizer step", self.step + 1):
            self.scaler.step(self.optimizer)  # fp16: skipped when the gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.last_norm, self.last_scale = norm, scale
        new_scale = loss_scale(self.scaler) if fp16 else None
        flags = self.checks.flags(self.stop.requested, self.loss_sum, norm, scale, new_scale)
        return self.checks.agree(self.step, Agreement(flags, self.ctx.device), flags, self.epoch)

    def read_agreement(self):
        """Act on the last step's agreement now; returns whether all ranks agreed to stop."""
        return self.checks.read(self.epoch)

    def _finish_collectives(self):
        """Wait (locally, no new collective) until no collective of this rank is in flight: the
        profiler must not start or stop while one is. A gloo all-reduce started while
        recording ends on gloo's thread, after profiler.stop() has freed what it writes into:
        heap corruption, about 1 run in 6 when the step agreement was in flight."""
        self.checks.wait()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    # --- evaluation and the metrics line --------------------------------------------------

    def _evaluate_and_report(self):
        """Evaluate, write one metrics line (epoch and step) for the period since the last one."""
        timing = self.meter.end_period(self.samples_seen)
        train_loss = self.loss_totals.clone()
        dist.all_reduce(train_loss)
        metrics = {"epoch": self.epoch + 1, "step": self.step, "train_loss": (train_loss[0] / train_loss[1]).item()}
        metrics.update(self.evaluate(), **timing)
        metrics["model_state_mb"] = model_state_bytes(self.model, self.optimizer) / 2**20  # rank 0's share
        metrics.update(self.lrs)  # --lr's (AdamW's), and --muon_lr's under Muon
        # Stops every rank if the output folder was taken over (rank 0's fence: folder_claim).
        agree(self.ctx, "metrics_line", self.meter.write_line(metrics, self.samples_seen), self.cfg.timeout_seconds)
        self.collector.collect()
        self.last_evaluated = self.step
        # The loss sums restart after each line (and carry over in a checkpoint).
        self.loss_totals.zero_()

    def evaluate(self):
        """The task's metrics over the whole validation set, the same on every rank."""
        with self.memory.during("evaluation", self.step):
            return self.validator.evaluate()

    def close(self, status):
        """status: finished, preempted, failed (agreed by all ranks) or crashed."""
        self.collector.close()  # cleanup_distributed's collection must reach DDP's reducer (its cycles)
        self.watchdog.close()
        # Stopping waits for collectives in flight, maybe with a peer that is gone.
        if status != "crashed":
            self.profiler.stop()
        self.reporter.close(status)
        self.strategy.close()
        # The loaders' workers end now, in order: each gets its stop message and exits at once.
        # Left to the garbage collector at exit, their queues may be gone first, and each
        # worker would be waited for in vain, 5 s apiece.
        self.train_loader = self.val_loader = self.validator = None
