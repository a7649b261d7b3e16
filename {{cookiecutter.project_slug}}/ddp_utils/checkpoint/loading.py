"""Which checkpoint a run resumes from, and reading one back checked, of either kind.

Checkpoints are found newest first; a damaged one is skipped for an older one, with a warning;
none readable is an error, never a silent fresh start.
"""

import math
import os
from pathlib import Path

import torch

from ..core.logs import warn_main
from ..errors import CheckpointError
from .sharded import check_sharded_checkpoint


def load_checkpoint(path):
    """Load one checkpoint; a damaged or foreign one raises CheckpointError naming it.

    A file (--strategy ddp) is the whole state. A folder (--strategy fsdp) gives the trainer's
    state only, after checking that every shard its metadata names is there in full; the
    model and optimizer shards are read later, by every rank (load_sharded_checkpoint).

    The file is memory-mapped on the host, not read: each process copies what it needs from
    it (onto its GPU, with load_state_dict), and the pages are the operating system's file
    cache, shared by the processes of a node; nothing is first put whole on any GPU.
    """
    path = Path(path)
    try:
        if path.is_dir():
            check_sharded_checkpoint(path)
            path = path / "trainer.pt"
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # truncated zip, unpickling error, wrong format, I/O error
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}: {error})") from None


def checkpoint_candidates(checkpoint_dir):
    """Every checkpoint in `checkpoint_dir`, newest first: by the step in its name, `last.pt`
    (or the folder `last` links to) before the numbered checkpoint it is the newest of. A
    folder holding both kinds (--strategy switched) is ordered by step across them."""
    checkpoint_dir = Path(checkpoint_dir)
    numbered = [(int(p.name.removesuffix(".pt").removeprefix("step_")), 0, p) for p in checkpoint_dir.glob("step_*")
                if p.name.removesuffix(".pt").removeprefix("step_").isdigit()]  # fmt: skip
    ordered = list(numbered)
    for name in ("last.pt", "last"):
        last = checkpoint_dir / name
        if last.exists():
            same_kind = [(step, path) for step, _, path in numbered if path.is_dir() == last.is_dir()]
            # The numbered checkpoint it is (a hard link, a symbolic link), else the newest of its kind.
            steps = [step for step, path in same_kind if os.path.samefile(path, last)] or [
                max((step for step, _ in same_kind), default=math.inf)
            ]
            ordered.append((steps[0], 1, last))
    return [path for _, _, path in sorted(ordered, key=lambda entry: entry[:2], reverse=True)]


def load_latest_checkpoint(checkpoint_dir, sharded_only=False):
    """The newest readable checkpoint in `checkpoint_dir`, skipping damaged ones with a warning:
    a file (--strategy ddp) or a folder of shards (fsdp); with `sharded_only` folders alone
    (--strategy fsdp reads no one-file checkpoint; ddp reads both).

    Returns (state, path), or (None, None) when the folder holds no checkpoint at all.
    Raises CheckpointError when checkpoints exist but none is readable: starting fresh
    over them would silently throw a run away.
    """
    everything = checkpoint_candidates(checkpoint_dir)
    candidates = [path for path in everything if path.is_dir() or not sharded_only]
    if everything and everything[0] not in candidates:
        raise CheckpointError(
            f"the newest checkpoint in {checkpoint_dir}, {everything[0].name}, is one file (--strategy ddp), which "
            "--strategy fsdp does not read: resume with --strategy ddp, or pass another --output_dir"
        )
    for path in candidates:
        try:
            return load_checkpoint(path), path
        except CheckpointError as error:
            warn_main(f"{error}; trying an older checkpoint")
    if candidates:
        names = ", ".join(str(p) for p in candidates)
        raise CheckpointError(f"no readable checkpoint among {names}; delete them or pass --resume none")
    return None, None
