"""Train a model with PyTorch DistributedDataParallel.

The same script runs as one process or many:

    python train.py --epochs 2
    torchrun --standalone --nproc_per_node=2 train.py --epochs 2

Read top to bottom: learning-rate schedule, the Trainer (setup, resume, loop, evaluation,
checkpoints), then `main`, which owns the process group's lifetime.
"""

import contextlib
import logging
import math
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from config import parse_config
from dataset import build_loaders, mix_seed, seed_everything, start_epoch
from ddp_utils import (
    CheckpointError,
    StopRequest,
    Watchdog,
    any_rank,
    checkpoint_candidates,
    cleanup_distributed,
    load_checkpoint,
    load_latest_checkpoint,
    rank_zero_only,
    save_checkpoint,
    setup_distributed,
    setup_logging,
)
from metrics import Reporter, flops_per_sample, format_metrics, mfu, peak_memory_mb, peak_tflops
from model import build_model

log = logging.getLogger("train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
MODEL_SHAPE_FIELDS = ("input_dim", "hidden_dim", "num_classes")


class TrainingError(RuntimeError):
    """An error every rank agrees on; reported once, without a traceback."""


class Preempted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def lr_at(step, cfg, total_steps):
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps - 1))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def register_comm_hook(model, name):
    """Compress gradients before DDP's all-reduce: fewer bytes over slow inter-node links."""
    if name in ("bf16", "fp16"):
        model.register_comm_hook(None, compressed_allreduce_hook(AMP_DTYPES[name]))
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def compressed_allreduce_hook(dtype):
    """Average each gradient bucket in `dtype` (half the bytes of fp32), then copy it back.

    The same arithmetic as PyTorch's fp16/bf16_compress_hook, which refuses to run on gloo.
    """

    def hook(process_group, bucket):
        group = process_group or dist.group.WORLD
        compressed = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
        reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(future):
            return bucket.buffer().copy_(future.value()[0])

        return reduced.then(decompress)

    return hook


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
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.train_loader, self.val_loader = build_loaders(cfg, ctx)
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps
        if self.steps_per_epoch == 0:
            global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum_steps
            raise TrainingError(
                f"--train_samples {cfg.train_samples} is less than one global batch "
                f"(batch_size x world_size x grad_accum_steps = {global_batch})"
            )
        self.total_steps = cfg.epochs * self.steps_per_epoch

        # Same initial weights on every rank (DDP also broadcasts rank 0's at wrap time);
        # afterwards each rank gets its own stream for anything random it does.
        seed_everything(cfg.seed)
        model = build_model(cfg).to(ctx.device)
        seed_everything(mix_seed(cfg.seed, ctx.rank))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        # fp16 needs loss scaling; for bf16 and none the scaler is a no-op pass-through.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels once
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
        self.model = DDP(
            model,
            device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
            find_unused_parameters=cfg.find_unused_parameters,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        register_comm_hook(self.model, cfg.comm_hook)
        # torch.compile goes around the DDP wrapper, so DDP's bucketing is compiled in step with
        # the graph (PyTorch's documented order); no_sync() still acts on the wrapper.
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        self.flops_per_sample = flops_per_sample(model)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
        self.peak_tflops = peak_tflops(device_name, cfg.amp, cfg.peak_tflops) if device_name else cfg.peak_tflops
        try:
            self.reporter = Reporter(ctx, cfg, self.output_dir)
        except ImportError:
            raise TrainingError("--tensorboard true needs the tensorboard package: pip install tensorboard") from None

        self.epoch = 0  # current epoch (0-based)
        self.step = 0  # optimizer steps done in the whole run
        self.batches_done = 0  # micro-batches done by each rank in the current epoch
        self.loss_totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # sum, count
        self.stop = StopRequest()
        # Fires a little before the collective timeout, so stacks are written before the job ends.
        self.watchdog = Watchdog(0.9 * cfg.timeout_seconds, ctx.rank, self.stop)

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
        # could pick different files after a transient read error and silently diverge.
        path, error, state = self._choose_checkpoint() if ctx.is_main else (None, None, None)
        choice = [(path, error)]
        dist.broadcast_object_list(choice, src=0)
        path, error = choice[0]
        if error:
            raise CheckpointError(error)
        if path is None:
            return
        if state is None:
            try:
                state = load_checkpoint(Path(path), ctx.device)
            except CheckpointError as failure:
                error = str(failure)
        if any_rank(error is not None, device=ctx.device)[0]:
            raise CheckpointError(error or f"checkpoint {path} is unreadable on another rank")
        self.load_state(state, Path(path))

    def _choose_checkpoint(self):
        """(path or None, error or None, state or None), decided by rank 0 alone."""
        try:
            if self.cfg.resume == "auto":
                state, path = load_latest_checkpoint(self.checkpoint_dir, self.ctx.device)
                return (str(path) if path else None), None, state
            return self.cfg.resume, None, load_checkpoint(Path(self.cfg.resume), self.ctx.device)
        except CheckpointError as error:
            return None, str(error), None

    def load_state(self, state, path):
        saved = state["config"]
        mismatched = [
            f"--{name} is {getattr(self.cfg, name)}, the checkpoint's is {saved[name]}"
            for name in MODEL_SHAPE_FIELDS
            if saved[name] != getattr(self.cfg, name)
        ]
        if mismatched:
            raise TrainingError(f"checkpoint {path} has another model shape: {', '.join(mismatched)}")
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step = state["epoch"], state["step"]
        # The position in the epoch as samples of the one shuffled order, so it converts to
        # another world size, batch size or accumulation if it falls on a whole global batch.
        samples_done, world_size = state["samples_done"], self.ctx.world_size
        global_batch = self.cfg.batch_size * world_size * self.cfg.grad_accum_steps
        if samples_done % global_batch:
            raise TrainingError(
                f"checkpoint {path} stopped {samples_done} samples into epoch {self.epoch + 1}, not a whole "
                f"number of global batches of {global_batch} (batch_size x processes x grad_accum_steps): resume "
                "with the sizes it was saved with, or from an epoch-end checkpoint"
            )
        self.batches_done = samples_done // (self.cfg.batch_size * world_size)
        ranks = state["ranks"]
        if len(ranks) == world_size:
            set_rng_state(ranks[self.ctx.rank]["rng"])
            self.loss_totals.copy_(ranks[self.ctx.rank]["loss_totals"])
        elif self.ctx.is_main:
            # Another world size: the data order continues unchanged (it depends on seed and
            # epoch only); per-rank generators restart and rank 0 carries the loss so far.
            self.loss_totals.copy_(sum(rank["loss_totals"] for rank in ranks))
        self.reporter.truncate(self.step)
        report("resumed from %s: epoch %d, step %d", path, self.epoch + 1, self.step)

    # --- checkpoints ----------------------------------------------------------------------

    def _save_checkpoint(self):
        # Per-rank state (random generators, partial loss sums) is gathered to rank 0, which
        # writes one file; a collective, so every rank calls this.
        self.watchdog.beat(f"checkpoint at step {self.step}")
        ranks = [None] * self.ctx.world_size
        dist.all_gather_object(ranks, {"rng": rng_state(), "loss_totals": self.loss_totals.cpu()})
        state = {
            "model": self.model.module.state_dict(),  # unwrapped: no "module." prefix
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,  # the learning rate is a pure function of it (lr_at)
            "batches_done": self.batches_done,  # micro-batches per rank, for people reading it
            "samples_done": self.batches_done * self.cfg.batch_size * self.ctx.world_size,  # for resuming
            "world_size": self.ctx.world_size,
            "ranks": ranks,
            "config": self.cfg.to_dict(),
        }
        save_checkpoint(self.ctx, state, self.checkpoint_dir, self.step, self.cfg.keep_checkpoints)

    # --- training -------------------------------------------------------------------------

    def train(self):
        cfg = self.cfg
        if self.epoch >= cfg.epochs:
            report("run already complete: %d epochs, %d steps", self.epoch, self.step)
            return
        global_batch = cfg.batch_size * self.ctx.world_size * cfg.grad_accum_steps
        report("training %d epochs of %d steps, global batch %d", cfg.epochs, self.steps_per_epoch, global_batch)
        while self.epoch < cfg.epochs:
            started, cpu_started = time.perf_counter(), time.process_time()
            samples, data_wait_s = self._run_epoch()
            train_seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
            train_loss = self._reduce_train_loss()
            samples_per_s = samples / train_seconds
            metrics = {
                "epoch": self.epoch + 1,
                "step": self.step,
                "train_loss": train_loss,
                **self.evaluate(),
                "samples_per_s": samples_per_s,
                "data_wait_s": data_wait_s,  # rank 0's time waiting for batches
                "compute_s": train_seconds - data_wait_s,  # the rest of the epoch's training time
                "cpu_s": cpu_seconds,  # rank 0's CPU time while training: host overhead shows here
                "peak_memory_mb": peak_memory_mb(self.ctx.device),  # rank 0's
                "lr": self.optimizer.param_groups[0]["lr"],
            }
            utilisation = mfu(self.flops_per_sample, samples_per_s, self.ctx.world_size, self.peak_tflops)
            if utilisation is not None:
                metrics["mfu"] = utilisation
            self.reporter.epoch_metrics(metrics)
            report("%s", format_metrics(metrics))
            self.epoch, self.batches_done = self.epoch + 1, 0
            self.loss_totals.zero_()
            self._save_checkpoint()

    def _run_epoch(self):
        """Train until the end of the epoch; returns the number of samples trained (all ranks)."""
        cfg, ctx = self.cfg, self.ctx
        accum = cfg.grad_accum_steps
        global_micro_batch = cfg.batch_size * ctx.world_size
        start_epoch(self.train_loader, self.epoch, ctx.rank, cfg.seed, start=self.batches_done * global_micro_batch)
        self.model.train()
        first_batch = self.batches_done
        self.reporter.start_epoch(self.epoch + 1, cfg.epochs, self.steps_per_epoch, first_batch // accum)
        epoch_started = time.perf_counter()
        data_wait_s, waiting_since = 0.0, epoch_started
        for micro_step, (inputs, targets) in enumerate(self.train_loader, start=first_batch):
            data_wait_s += time.perf_counter() - waiting_since
            self.watchdog.beat(f"training, optimizer step {self.step + 1}")
            last_micro_step = (micro_step + 1) % accum == 0
            loss = self._run_batch(inputs, targets, sync=last_micro_step)
            if not last_micro_step:
                waiting_since = time.perf_counter()
                continue
            stop = self._optimizer_step()
            self.batches_done = micro_step + 1
            if stop:  # agreed by all ranks: save where we are and exit
                self._save_checkpoint()
                raise Preempted(self.stop.signum or signal.SIGTERM)
            if cfg.log_every_steps and self.step % cfg.log_every_steps == 0:
                # Reading the loss waits for the device: only every log_every_steps steps.
                loss_value = loss.item()
                samples_per_s = (
                    (micro_step + 1 - first_batch) * global_micro_batch / (time.perf_counter() - epoch_started)
                )
                report("step %d loss %.4f lr %.3g", self.step, loss_value, self.optimizer.param_groups[0]["lr"])
                self.reporter.train_loss(self.step, loss_value)
                self.reporter.step(loss_value, samples_per_s)
            else:
                self.reporter.step()
            mid_epoch = self.batches_done < self.steps_per_epoch * accum
            if mid_epoch and cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0:
                self._save_checkpoint()
            waiting_since = time.perf_counter()
        self.reporter.end_epoch()
        return (self.batches_done - first_batch) * global_micro_batch, data_wait_s

    def _run_batch(self, inputs, targets, sync):
        inputs = inputs.to(self.ctx.device, non_blocking=True)
        targets = targets.to(self.ctx.device, non_blocking=True)
        # Gradients are all-reduced only on the last micro-step of an optimizer step.
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = F.cross_entropy(self._forward(inputs), targets)
            self.scaler.scale(loss / self.cfg.grad_accum_steps).backward()
        loss = loss.detach()
        self.loss_totals[0] += loss.double() * len(targets)
        self.loss_totals[1] += len(targets)
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

    def _optimizer_step(self):
        """Clip, step and schedule; returns whether all ranks agreed to stop after this step."""
        cfg = self.cfg
        finite = torch.isfinite(self.loss_totals[0])  # every micro-step's loss so far this epoch
        if cfg.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the loss-scaled ones
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            finite = finite & torch.isfinite(norm)
        # One small all-reduce per optimizer step makes every rank take the same decision:
        # a rank that stopped alone would leave the others waiting in the next all-reduce.
        stop, non_finite = any_rank(self.stop.requested, ~finite, device=self.ctx.device)
        if non_finite and cfg.amp != "fp16":  # fp16: the scaler skips the step and lowers the scale
            raise TrainingError(
                f"loss or gradients are not finite at optimizer step {self.step + 1} (epoch {self.epoch + 1}); "
                "lower --lr or set --max_grad_norm"
            )
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, cfg, self.total_steps)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return stop

    def _reduce_train_loss(self):
        totals = self.loss_totals.clone()
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Loss and accuracy over exactly the whole validation set, on every rank."""
        model = self.model.module  # no DDP forward: nothing to synchronise in evaluation
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss sum, correct, count
        for inputs, targets in self.val_loader:
            self.watchdog.beat("evaluation")
            inputs = inputs.to(self.ctx.device, non_blocking=True)
            targets = targets.to(self.ctx.device, non_blocking=True)
            with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                logits = model(inputs)
            totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += len(targets)
        dist.all_reduce(totals)  # sums and counts, not an average of per-rank averages
        model.train()
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_samples": int(count)}


def run(cfg, ctx):
    """Train; returns the exit code. Everything holding process-group work (DDP's reducer)
    is released when this returns, before the group is destroyed."""
    setup_logging(ctx, cfg.output_dir)
    trainer = None
    try:
        trainer = Trainer(cfg, ctx)
        trainer.resume()
        trainer.train()
    except (TrainingError, CheckpointError) as error:
        report("%s", error, level=logging.ERROR)
        return 1
    except Preempted as stop:
        report("stopped by %s at step %d; checkpoint saved, run the same command to resume", stop, trainer.step)
        return 128 + stop.signum
    except RuntimeError as error:  # gloo and NCCL report a collective timeout as a RuntimeError
        if trainer is None or "timed out" not in str(error).lower():
            raise
        log.error(
            "a collective timed out after --timeout_seconds %d during %s: another rank stalled or died "
            "(see the ranks' stacks above)",
            cfg.timeout_seconds, trainer.watchdog.phase,
        )  # fmt: skip
        return 1
    finally:
        if trainer is not None:
            trainer.watchdog.close()
            trainer.reporter.close()
    return 0


def main(argv=None):
    cfg = parse_config(argv)
    ctx = setup_distributed(cfg.timeout_seconds)
    try:
        return run(cfg, ctx)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
