"""One-file checkpoints (--strategy ddp), written whole or not at all.

`checkpoints/step_000000040.pt`, written by rank 0 to a temporary name and renamed; `last.pt` is
a second name (a hard link) for the newest. The other ranks wait for the write through the store.
"""

import os
from pathlib import Path

import torch

from ..core.files import WRITER, fenced, remove_leftovers, write_atomically
from ..core.logs import rank_zero_only
from ..distributed.store_waits import store_barrier
from ..errors import CheckpointError, FolderLost
from .space import SPACE_ERRNOS, one_file_bytes, save_failure, tensor_bytes


def save_checkpoint(ctx, state, checkpoint_dir, step, keep, timeout_seconds):
    """Write `state` as last.pt (and step_<step>.pt) atomically; call on every rank.

    Global rank 0 writes; the others wait for it through the store, for up to `timeout_seconds`
    (not --timeout_seconds: a large checkpoint on a slow file system takes its time). A failed
    write stops every rank with the same error instead of a hang; a full disk is said in plain
    words, with the space free and needed (checkpoint_space.save_failure).
    """
    error = _write_checkpoint(state, Path(checkpoint_dir), step, keep)
    error = store_barrier(ctx, f"checkpoint_step_{step}", error, timeout_seconds)
    if error:
        raise CheckpointError(error)


@rank_zero_only
def _write_checkpoint(state, checkpoint_dir, step, keep):
    """Each step that changes what the folder holds (the file in place, `last.pt`, pruning) is
    fenced: a run whose folder was taken over stops before it, its own temporary file removed."""
    try:
        fenced()
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        last = checkpoint_dir / "last.pt"
        if keep == 0:
            atomic_save(state, last)
        else:
            numbered = checkpoint_dir / f"step_{step:09d}.pt"
            atomic_save(state, numbered)
            # last.pt is a second name for the same file: no second write, still atomic.
            _atomic_link(numbered, last, state)
            # The newest `keep` stay, this one always: the folder may hold newer steps (a resume
            # from another folder, a smaller --keep_checkpoints), which go before it does.
            others = sorted(p for p in checkpoint_dir.glob("step_*.pt") if p != numbered)
            fenced()
            for old in others[: len(others) - (keep - 1)]:
                old.unlink()
        remove_leftovers(checkpoint_dir)  # a save killed half-way, by this run or an earlier one
        fsync_dir(checkpoint_dir)
    except FolderLost as lost:  # the new owner's files are left as they are
        return str(lost)
    except Exception as error:  # OSError, or torch.save's RuntimeError when the disk fills mid-write
        # The temporary file is gone (write_atomically): the free space is what the save found.
        return save_failure(checkpoint_dir, step, error, one_file_bytes(tensor_bytes(state)), keep)
    return None


def atomic_save(state, path):
    write_atomically(path, lambda f: torch.save(state, f))


def _atomic_link(target, path, state):
    tmp = path.with_name(f".{WRITER}.{path.name}.link")  # this writer's: never a stalled run's or a new owner's
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError as error:  # a file system without hard links: write the state again
        if error.errno in SPACE_ERRNOS:  # not for a full disk, where it fails again, slowly
            raise
        atomic_save(state, path)
    else:
        try:
            fenced()
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
