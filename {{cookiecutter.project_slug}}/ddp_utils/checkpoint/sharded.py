"""Sharded checkpoints (--strategy fsdp): one folder per checkpoint, every rank writing its shards.

checkpoints/step_000000040/ holds one .distcp file per rank (its shards of the model and
optimizer state), DCP's .metadata, and trainer.pt (epoch, step, random generators, config),
written into .step_000000040.<writer>.tmp/ (rank 0's files.WRITER: a stalled run whose folder
was taken over never writes into, nor removes, the new owner's) and renamed when complete.
`last` is a symbolic link to the newest one, replaced atomically.
"""

import os
import shutil
from pathlib import Path

from ..core.files import WRITER, fenced, remove_leftovers, replace_folder
from ..core.logs import rank_zero_only, warn_main
from ..distributed.store_waits import share_from_main, store_barrier
from ..errors import CheckpointError, FolderLost
from .single_file import atomic_save, fsync_dir
from .space import first_line, one_file_bytes, save_failure, sharded_bytes, tensor_bytes


class PendingCheckpoint:
    """A sharded checkpoint being written; `finish()` waits for it, then makes it the newest. A
    failed one (`failure`: what DCP raised) is removed, the checkpoints before it untouched."""

    def __init__(self, ctx, future, tmp, final, keep, timeout_seconds, size, failure=None):
        self.ctx, self.future, self.tmp, self.final = ctx, future, tmp, final
        self.keep, self.timeout_seconds = keep, timeout_seconds
        self.size, self.failure = size, failure  # the whole checkpoint's bytes, for a full disk's message

    def finish(self):
        failure = self.failure
        if failure is None and self.future is not None:
            try:
                self.future.result()
            except dcp_failures() as caught:  # DCP's CheckpointException: every rank sees the same
                failure = caught
        error = first_line(failure) if failure else None
        error = store_barrier(self.ctx, f"sharded_written_{self.final.name}", error, self.timeout_seconds)
        if error:  # no rank writes into it any more: removed, then the free space is what the save found
            error = _abandon(self.tmp, self.final, failure or error, self.size, self.keep)
        else:
            error = _publish_sharded(self.tmp, self.final, self.keep, self.size)
        error = store_barrier(self.ctx, f"sharded_published_{self.final.name}", error, self.timeout_seconds)
        if error:
            raise CheckpointError(error)


def dcp_failures():
    """What a failed DCP save or load raises: its CheckpointException is a BaseException, which
    `except Exception` would let through, and the run would crash instead of saying why."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def save_sharded_checkpoint(ctx, sharded, trainer_state, checkpoint_dir, step, keep, timeout_seconds, group, stager):
    """Start writing a sharded checkpoint on every rank; returns the PendingCheckpoint to finish.

    With a `stager` (DCP's AsyncStager), DCP copies the shards into its host buffers and writes
    them in a thread (on `group`, a process group of its own) while training goes on; without,
    it writes them before returning.
    """
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step:09d}"
    size, _ = sharded_bytes(
        tensor_bytes(sharded, once=False), ctx.world_size, one_file_bytes(tensor_bytes(trainer_state))
    )
    name = f".{final.name}.{WRITER}.tmp"  # rank 0's writer, the name on every rank
    error = _prepare_sharded(checkpoint_dir / name, trainer_state, step, size, keep)
    error, name = share_from_main(ctx, f"sharded_tmp_{final.name}", [error, name], timeout_seconds)
    tmp = checkpoint_dir / name
    # Every rank fenced before it writes a shard (its own read of the claim): each may have
    # stalled apart, and all write or none (DCP's save is collective).
    error = store_barrier(ctx, f"sharded_prepared_{final.name}", error or _fence_line(), timeout_seconds)
    if error:
        raise CheckpointError(error)
    future = failure = None
    try:
        if stager is None:
            dcp.save(sharded, checkpoint_id=str(tmp), process_group=group)
        else:
            future = dcp.async_save(sharded, checkpoint_id=str(tmp), process_group=group, async_stager=stager)
    except dcp_failures() as caught:  # every rank sees the same
        failure = caught
    pending = PendingCheckpoint(ctx, future, tmp, final, keep, timeout_seconds, size, failure)
    if failure is not None:
        pending.finish()  # raises, once every rank is done with the partial folder and it is gone
    return pending


@rank_zero_only
def _prepare_sharded(tmp, trainer_state, step, size, keep):
    try:
        fenced()  # before anything is removed or written: no rank writes a shard otherwise
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
        tmp.mkdir(parents=True)
        atomic_save(trainer_state, tmp / "trainer.pt")
    except FolderLost as lost:
        return str(lost)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        return save_failure(tmp.parent, step, error, size, keep)
    return None


def _fence_line():
    try:
        fenced()
    except FolderLost as lost:
        return str(lost)
    return None


@rank_zero_only
def _abandon(tmp, final, failure, size, keep):
    """Remove the partial checkpoint `tmp`; returns the line that says why it failed."""
    shutil.rmtree(tmp, ignore_errors=True)
    return save_failure(final.parent, _step(final), failure, size, keep)


def _step(final):
    return int(final.name.removeprefix("step_"))


@rank_zero_only
def _publish_sharded(tmp, final, keep, size):
    """Rename the complete `tmp` to `final`, point `last` at it, then prune: at every moment
    `last` and the step folders are complete checkpoints."""
    try:
        fsync_dir(tmp)
        fenced()  # a folder taken over meanwhile: this run's shards are removed, nothing of the new owner's touched
        # The same step may be saved again (a run resumed from an older one).
        replace_folder(tmp, final)
        link = final.parent / f".{WRITER}.last.link"  # this writer's (files.remove_leftovers)
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, final.parent / "last")
        fsync_dir(final.parent)
        # The newest `keep` step folders stay (at least the one `last` names), never this one.
        others = sorted(p for p in final.parent.glob("step_*") if p.is_dir() and p != final)
        fenced()
        for old in others[: len(others) - max(keep - 1, 0)]:
            shutil.rmtree(old)
        # Partial checkpoints of saves killed half-way, by earlier runs (each writer's own names).
        for leftover in final.parent.glob(".step_*.tmp"):
            if leftover.is_dir() and not leftover.name.endswith(f".{WRITER}.tmp"):
                shutil.rmtree(leftover, ignore_errors=True)
        remove_leftovers(final.parent)
    except FolderLost as lost:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(lost)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)  # not yet in place: never a checkpoint
        return save_failure(final.parent, _step(final), error, size, keep)
    return None


def check_sharded_checkpoint(path):
    """Raise if a shard named in the checkpoint's metadata is missing or cut short."""
    # DCP is imported where it is used: it pulls in DTensor and sympy, 1.5 s of start-up per
    # process that ddp runs (one-file checkpoints) never need.
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    for info in metadata.storage_data.values():
        shard = Path(path) / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            raise ValueError(f"shard {shard.name} is missing or cut short")


def sharded_param_groups(path):
    """How many optimizer parameter groups the sharded checkpoint at `path` holds."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({key.split(".")[2] for key in keys if key.startswith("optimizer.param_groups.")})


def load_sharded_checkpoint(path, sharded, group):
    """Read this rank's shards of `sharded` from the checkpoint folder `path`, in place; every
    rank calls it (DCP reshards to this world size)."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: see check_sharded_checkpoint

    try:
        dcp.load(sharded, checkpoint_id=str(path), process_group=group)
    except dcp_failures() as failure:  # DCP's CheckpointException: every rank sees the same
        raise CheckpointError(f"checkpoint {path} is unreadable: {first_line(failure)}") from None


def read_sharded_state(model, optimizer, path, group):
    """Load a sharded checkpoint (the folder `path`) into `model` and `optimizer` on every rank:
    each reads what its own parameters hold, whatever world size, mesh or strategy wrote it
    (DCP reshards; a plain module reads whole tensors). Collective over `group`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    sharded = {"model": model_state, "optimizer": optimizer_state}
    ours = optimizer_state["param_groups"]
    # Saved before build_optimizer's two groups: read it as the one group it has. The state
    # is keyed by parameter name, so only the groups' settings differ: this run's are kept.
    one_group = len(ours) > 1 and sharded_param_groups(path) == 1
    if one_group:
        optimizer_state["param_groups"] = [{**ours[0], "params": [name for g in ours for name in g["params"]]}]
    load_sharded_checkpoint(path, sharded, group)
    if one_group:
        sharded["optimizer"]["param_groups"] = ours
        warn_main(ONE_GROUP_NOTE.format(path=path))
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])


ONE_GROUP_NOTE = (
    "checkpoint {path} was saved with weight decay on every parameter: resuming with its optimizer state, "
    "biases and normalisation weights no longer decay"
)


def regroup_optimizer_state(saved, optimizer, parameters, path):
    """An optimizer state saved before the two parameter groups of build_optimizer (one group of
    every parameter, in the model's order), as this optimizer's groups hold the same parameters;
    `parameters`: the model's, in its order. The state (Adam's moments, step) carries over;
    the groups' settings are this run's. Any other saved state is returned as it is."""
    if len(saved["param_groups"]) != 1 or len(optimizer.param_groups) == 1:
        return saved
    old_index = {id(p): i for i, p in enumerate(parameters)}
    ours = [p for group in optimizer.param_groups for p in group["params"]]
    if len(ours) != len(parameters) or len(saved["param_groups"][0]["params"]) != len(parameters):
        raise CheckpointError(f"checkpoint {path} has an optimizer state for other parameters than this model's")
    warn_main(ONE_GROUP_NOTE.format(path=path))
    new_index = {old_index[id(p)]: i for i, p in enumerate(ours)}
    state = {new_index[i]: value for i, value in saved["state"].items()}
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
