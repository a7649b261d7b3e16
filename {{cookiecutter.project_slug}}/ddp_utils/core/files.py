"""Files and folders written whole or not at all: what a crash, a kill or a full disk leaves is
either the previous complete version or the new one, never half of either."""

import os
import shutil
import uuid
from pathlib import Path

from ..errors import FolderLost

# In this process's temporary names: two runs that write the same file (one stalled, its folder
# taken over meanwhile by the other) never write into one temporary file.
WRITER = uuid.uuid4().hex[:8]
_fence = None  # set by folder_claim while this process writes into a run's output folder
_lost = None  # and this: what it knows without reading the claim (every step, every log line)


def fence(check, lost=None):
    """Guard every write into the output folder with `check()`: None while this process may
    write there, else the line saying why not (folder_claim sets it on every rank of a run
    that holds the folder, and clears it with None). `lost()`: the same answer, as far as the
    claim's heartbeat has seen it (cheap: asked every step and before each line of train.log)."""
    global _fence, _lost
    _fence, _lost = check, lost


def folder_lost():
    """The line that stops the run once its output folder is known to be another run's, else
    None: what the claim's heartbeat last saw, no file read (but after a stall, folder_claim)."""
    return _lost() if _lost is not None else None


def fenced():
    """Raise FolderLost, with the line that names the new owner, if this process may no longer
    write into its output folder: called just before each write that another run could lose."""
    problem = _fence() if _fence is not None else None
    if problem:
        raise FolderLost(problem)


def write_atomically(path, write, mode="wb", **open_args):
    """`write(f)` fills a temporary file beside `path` (opened with `mode` and `open_args`),
    renamed to `path` once it is on disk. A crash or a full disk while writing leaves only the
    temporary file behind, and it is removed when this raises."""
    path = Path(path)
    tmp = path.with_name(f".{WRITER}.{path.name}.tmp")
    try:
        with open(tmp, mode, **open_args) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        fenced()  # the folder may have been taken over while this was written
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_leftovers(folder):
    """Remove the temporary files and links (`last`'s next name) that other processes left in
    `folder` (killed mid-write). Only while this process holds the folder (fenced): a stalled
    writer whose file goes never puts it in place, as its fence stops it first."""
    for pattern in (".*.tmp", ".*.link"):
        for leftover in Path(folder).glob(pattern):
            mine = leftover.name.startswith(f".{WRITER}.")
            if not mine and (leftover.is_symlink() or leftover.is_file()):
                leftover.unlink(missing_ok=True)


def replace_folder(tmp, out):
    """Put the complete folder `tmp` at `out`, in place of any folder there: at every moment
    `out` is the old folder or the new one (the old one is renamed aside, then removed)."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
