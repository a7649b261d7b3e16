"""The Checkpointer: which checkpoint to resume, loading it on every rank, saving where training
is, where in the epoch to continue, and whether the folder has room for the checkpoints before
the first step. single_file.py and sharded.py hold the formats on disk, loading.py reads them
back, space.py their sizes.

A checkpoint holds the model and optimizer state (one file under ddp, shards under fsdp: the
strategy's `save` and `load`), the loss scaler, the trainer's progress (epoch, step, samples),
each rank's random generators and partial loss sums, the config it was trained with, and what
predicting needs from the training data (the training set's `data_state()`: label names,
normalisation statistics).
"""

import contextlib
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..core.logs import log, report
from ..distributed.store_waits import agree, share_from_main, store_barrier
from ..errors import CheckpointError, TrainingError
from .loading import checkpoint_candidates, load_checkpoint, load_latest_checkpoint
from .space import one_file_bytes, optimizer_bytes, serialized_bytes, sharded_bytes, space, tensor_bytes


class Checkpointer:
    """Saves and restores one run's checkpoints in output_dir/checkpoints; every rank calls
    every method (rank 0 chooses and writes files, the others wait through the store)."""

    def __init__(self, cfg, ctx, strategy, optimizer, scaler, watchdog, shape_fields, data_state=None):
        self.cfg, self.ctx = cfg, ctx
        self.strategy, self.optimizer, self.scaler, self.watchdog = strategy, optimizer, scaler, watchdog
        self.shape_fields = shape_fields  # config fields a checkpoint must match (model.py's SHAPE_FIELDS)
        self.data_state = data_state  # what predicting needs from the training data (contract.data_state)
        self.folder = Path(cfg.output_dir) / "checkpoints"
        self.last_saved = None  # the step of the last checkpoint this process wrote

    def load(self):
        """The checkpoint --resume names (auto: the newest readable), its model, optimizer and
        scaler state already in place; returns (state, path), or (None, None) to start afresh."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.resume == "none":
            if checkpoint_candidates(self.folder):
                raise TrainingError(
                    f"--resume none, but {self.folder} holds checkpoints of an earlier run: "
                    "pass --resume auto to continue it, or another --output_dir to start fresh"
                )
            return None, None
        # Rank 0 chooses the file and every rank loads that one: ranks choosing on their own
        # could pick different files after a transient read error and silently diverge. The
        # choice and the outcome travel through the store: reading a large checkpoint from a
        # slow file system may take longer than --timeout_seconds.
        self.watchdog.beat("choosing the checkpoint to resume", seconds=cfg.checkpoint_timeout_seconds)
        path, error, state = self._choose() if ctx.is_main else (None, None, None)
        path, error = share_from_main(ctx, "resume_choice", [path, error], cfg.checkpoint_timeout_seconds)
        if error:
            raise CheckpointError(error)
        if path is None:
            return None, None
        path = Path(path)
        if state is None:
            try:
                state = load_checkpoint(path)
            except CheckpointError as failure:
                error = str(failure)
        error = store_barrier(ctx, "resume_loaded", error, cfg.checkpoint_timeout_seconds)
        if error:
            raise CheckpointError(error)
        self._restore(state, path)
        return state, path

    def _choose(self):
        """(path or None, error or None, state or None), decided by rank 0 alone."""
        try:
            if self.cfg.resume == "auto":
                state, path = load_latest_checkpoint(self.folder, self.strategy.sharded)
                return (str(path) if path else None), None, state
            return self.cfg.resume, None, load_checkpoint(Path(self.cfg.resume))
        except CheckpointError as error:
            return None, str(error), None

    def _restore(self, state, path):
        saved = state["config"]
        mismatched = [
            f"--{name} is {getattr(self.cfg, name)}, the checkpoint's is {saved[name]}"
            for name in self.shape_fields
            if saved[name] != getattr(self.cfg, name)
        ]
        if mismatched:
            raise TrainingError(f"checkpoint {path} has another model shape: {', '.join(mismatched)}")
        saved_optimizer = saved.get("optimizer", "adamw")  # checkpoints from before --optimizer: AdamW's
        if saved_optimizer != self.cfg.optimizer:
            raise TrainingError(
                f"checkpoint {path} holds the state of --optimizer {saved_optimizer}, not of --optimizer "
                f"{self.cfg.optimizer}: resume with --optimizer {saved_optimizer}, or start in another --output_dir"
            )
        with same_optimizer_implementation(self.optimizer):  # this machine's, not the saving one's
            self.strategy.load(state, path, self.optimizer)  # the model and optimizer state
        if self.scaler.is_enabled() and not state["scaler"]:
            report("checkpoint %s was trained without loss scaling (--amp %s): the fp16 loss scale starts afresh",
                   path, saved["amp"])  # fmt: skip
        else:
            self.scaler.load_state_dict(state["scaler"])  # a disabled scaler (bf16, none) ignores it

    def due(self, step):
        """Whether optimizer step `step` gets a checkpoint of its own (--checkpoint_every_steps)."""
        every = self.cfg.checkpoint_every_steps
        return bool(every) and step % every == 0

    def restore_rank(self, state, loss_totals):
        """This rank's random generators and partial loss sums, when the world size is the
        checkpoint's. With another world size the data order continues unchanged (it depends on
        seed and epoch only); per-rank generators restart and rank 0 carries the loss so far."""
        ranks = state["ranks"]
        if len(ranks) == self.ctx.world_size:
            set_rng_state(ranks[self.ctx.rank]["rng"])
            loss_totals.copy_(ranks[self.ctx.rank]["loss_totals"])
        elif self.ctx.is_main:
            loss_totals.copy_(sum(rank["loss_totals"] for rank in ranks))

    def save(self, progress, loss_totals, stopping=False):
        """Save `progress` (the trainer's counters: epoch, step, samples...) with the model,
        optimizer and scaler state, and every rank's generators and partial loss sums (gathered
        to rank 0, which writes them with the model (ddp) or beside the shards (fsdp)).
        `stopping`: the process exits next, so an asynchronous save is completed."""
        self.watchdog.beat(f"checkpoint at step {progress['step']}", seconds=self.cfg.checkpoint_timeout_seconds)
        ranks = [None] * self.ctx.world_size
        dist.all_gather_object(ranks, rank_state(loss_totals))
        self.strategy.save(self._state(progress, ranks), self.optimizer, self.folder, self.cfg)
        self.last_saved = progress["step"]
        if stopping:
            self.strategy.wait_for_checkpoint()

    def wait(self):
        """Until an asynchronous save in flight is complete (before the process exits)."""
        self.strategy.wait_for_checkpoint()

    def _state(self, progress, ranks):
        """A checkpoint's state but the model and optimizer, which the strategy adds (one file, or
        shards beside it)."""
        return {
            "scaler": self.scaler.state_dict(),
            **progress,
            "world_size": self.ctx.world_size,
            "ranks": ranks,
            "config": self.cfg.to_dict(),
            "data": self.data_state,
        }

    def space(self, progress, loss_totals):
        """(the Space of the checkpoint folder for this run's checkpoints, the bytes this rank
        writes of each): what `save` would write now, the model's tensors and the optimizer's state
        counted (checkpoint_space, as it will hold it before its first step), the trainer's state
        measured (every rank's generators as large as this one's). No collective."""
        ctx, sharded = self.ctx, self.strategy.sharded
        # torch.save writes a storage once (tied weights), DCP every name.
        tensors = tensor_bytes(self.strategy.module.state_dict(), once=not sharded) + optimizer_bytes(self.optimizer)
        trainer = serialized_bytes(self._state(progress, []))
        trainer += ctx.world_size * serialized_bytes(rank_state(loss_totals))
        if sharded:  # every rank writes its shards, rank 0 also trainer.pt
            size, own = sharded_bytes(tensors, ctx.world_size, trainer, ctx.is_main)
        else:  # rank 0 writes it all
            size = one_file_bytes(tensors, trainer)
            own = size if ctx.is_main else 0
        return space(self.folder, size, self.cfg.keep_checkpoints), own

    def check_space(self, progress, loss_totals):
        """Before the first step: stop every rank, with one line, when the checkpoint folder cannot
        hold this run's checkpoints at their peak (--keep_checkpoints kept and the one being
        written), as seen from each rank that writes (ddp: rank 0; fsdp: every rank): better now
        than at the first save, hours in. A check that cannot be made (an unreadable folder) is a
        warning: the saves say what goes wrong with them."""
        problem = None
        try:
            room, own = self.space(progress, loss_totals)
            problem = room.shortfall() if own else None
        except OSError as error:
            log.warning("could not check the room for checkpoints in %s: %s", self.folder, error)  # on its rank
        agree(self.ctx, "checkpoint_space", problem, self.cfg.timeout_seconds, error=CheckpointError)


def resume_position(samples_done, global_batch, steps_per_epoch, epoch):
    """Where to continue an epoch that a checkpoint stopped `samples_done` samples into (of the
    one shuffled order, so it converts to another world size, batch size or accumulation): the
    nearest whole global batch. `epoch` is 0-based. Returns (samples, warning or None)."""
    whole, rest = divmod(samples_done, global_batch)
    resume_at = min(whole + (2 * rest > global_batch), steps_per_epoch) * global_batch
    if resume_at == samples_done:
        return resume_at, None
    change = f"{samples_done - resume_at} samples are trained twice" if resume_at < samples_done else (
        f"{resume_at - samples_done} samples are skipped"
    )  # fmt: skip
    return resume_at, (
        f"stopped {samples_done} samples into epoch {epoch + 1}, not a whole number of global batches of "
        f"{global_batch}: resuming at sample {resume_at}, so {change} this epoch"
    )


def rank_state(loss_totals):
    """What a checkpoint holds of each rank: its random generators and partial loss sums."""
    return {"rng": rng_state(), "loss_totals": loss_totals.cpu()}


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


@contextlib.contextmanager
def same_optimizer_implementation(optimizer):
    """Keep the optimizer's implementation (fused, foreach) across loading a saved state, which
    would otherwise bring the saving machine's: a checkpoint from a CPU run resumed on GPUs
    would run unfused (and under fp16 fail in GradScaler, built for the fused step)."""
    chosen = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    yield
    for group, (fused, foreach) in zip(optimizer.param_groups, chosen, strict=True):
        if "fused" in group:  # AdamW's groups (Muon's have neither)
            group["fused"], group["foreach"] = fused, foreach
