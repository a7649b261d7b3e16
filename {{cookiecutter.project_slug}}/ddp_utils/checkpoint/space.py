"""Room for checkpoints: the one place that sizes a checkpoint (from the model's tensors and the
optimizer's state per parameter), says what the kept checkpoints take at their peak, reads the
free space of the file system they go to, and words a save that found the disk full. The
Checkpointer checks it before the first step; the preflight and the doctor report it.

What is estimated: the tensors' bytes are exact (each storage once: tied weights are saved
once), and so is the trainer's own state where it is measured (checkpoint.py); what the file
formats add per tensor is a measured constant (below); an optimizer that has not stepped yet is
counted as it will hold its state, measured on a stand-in (`_state_per_parameter`).
"""

import errno
import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..core.logs import first_line
from ..core.tensors import local
from ..core.units import size_text

# What a checkpoint adds to the bytes of each tensor it holds (measured with torch 2.13): in one
# file (ddp: torch.save's zip record of the storage, its 64-byte alignment, the pickle that
# rebuilds the tensor) about 300 bytes; under DCP (fsdp) each rank's shard of a tensor is a
# torch.save record of its own, with its entry in .metadata: about 1.8 KB. Against the files
# written, the estimate is 1% to 4% over (the tests' model: many small tensors).
FILE_TENSOR_BYTES = 320
SHARD_TENSOR_BYTES = 1800

SPACE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


# --- sizes ------------------------------------------------------------------------------


class Tensors(NamedTuple):
    """Tensors as a checkpoint holds them: their bytes (a DTensor's whole tensor), this rank's
    share of those (its shards), how many tensors, how many of them are sharded (DTensors), and
    how many other values sit beside them (DCP writes each as a record of its own: the
    optimizer's settings of each parameter group)."""

    whole: int = 0
    local: int = 0
    count: int = 0
    sharded: int = 0
    values: int = 0

    def __add__(self, other):
        return Tensors(*(a + b for a, b in zip(self, other, strict=True)))


def tensor_bytes(tree, once=True):
    """The Tensors in `tree` (nested dicts, lists and tuples: a state dict, a checkpoint's
    state); with `once`, each storage once, as torch.save writes them (tied weights); DCP writes
    every name (once=False)."""
    total, seen, todo = Tensors(), set(), [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, (list, tuple)) and any(
            isinstance(part, (dict, list, tuple, torch.Tensor)) for part in item
        ):
            todo += item
        elif not isinstance(item, torch.Tensor):  # a number, a string, a list of them: one value
            total += Tensors(values=1)
        else:
            shard = local(item)
            key = (shard.device, shard.untyped_storage().data_ptr()) if shard.numel() and once else id(item)
            if key not in seen:
                seen.add(key)
                total += Tensors(item.numel() * item.element_size(), shard.numel() * shard.element_size(), 1,
                                 int(shard is not item))  # fmt: skip
    return total


def optimizer_bytes(optimizer):
    """The Tensors of `optimizer`'s state, as tensor_bytes: as it holds them, and for a parameter
    it holds none for yet (before its first step) as it will."""
    total, profiles = Tensors(), {}
    for index, group in enumerate(optimizer.param_groups):
        total += Tensors(values=len(group))  # its settings and the list of its parameters
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if state:
                total += tensor_bytes(list(state.values()))
                continue
            shard = local(parameter)
            key = (index, shard.dtype, shard.device)
            if key not in profiles:
                profiles[key] = _state_per_parameter(optimizer, group, shard.dtype, shard.device)
            per_element, fixed, tensors, shaped = profiles[key]
            sharded = shaped if shard is not parameter else 0  # a DTensor parameter's moments are DTensors
            total += Tensors(per_element * parameter.numel() + fixed, per_element * shard.numel() + fixed, tensors,
                             sharded)  # fmt: skip
    return total


def _state_per_parameter(optimizer, group, dtype, device):
    """(bytes per element, bytes per parameter, tensors, tensors shaped as the parameter) of the
    state `optimizer` keeps for a parameter of `group`: measured on a stand-in of three elements
    that an optimizer of its kind, with the group's settings, steps once (AdamW: two moments of
    the parameter's dtype and a scalar step). One that cannot be built so is counted as AdamW
    (ddp_utils/optim/optimizer.py)."""
    stand_in = torch.zeros(3, dtype=dtype, device=device, requires_grad=True)
    stand_in.grad = torch.zeros_like(stand_in)
    try:
        twin = type(optimizer)([stand_in])
        twin.param_groups[0].update({key: value for key, value in group.items() if key != "params"})
        twin.step()
        state = [value for value in twin.state[stand_in].values() if isinstance(value, torch.Tensor)]
    except Exception:  # an optimizer whose constructor needs more than its parameters
        return 2 * stand_in.element_size(), 4, 3, 2
    shaped = [t for t in state if t.shape == stand_in.shape]
    fixed = sum(t.numel() * t.element_size() for t in state if t.shape != stand_in.shape)
    return sum(t.element_size() for t in shaped), fixed, len(state), len(shaped)


def serialized_bytes(value):
    """The bytes torch.save writes for `value` (a checkpoint's small parts: the trainer's state)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.tell()


def as_sharded(tensors, world_size):
    """`tensors` of a model and its optimizer in one process as fsdp holds them over `world_size`
    ranks: each one sharded (the optimizer's scalar steps too: a little over)."""
    return tensors._replace(local=-(-tensors.whole // world_size), sharded=tensors.count)


def one_file_bytes(tensors, trainer_bytes=0):
    """The bytes of a one-file checkpoint (ddp: rank 0 writes it) of `tensors` (tensor_bytes)
    and the trainer's state."""
    return tensors.whole + tensors.count * FILE_TENSOR_BYTES + trainer_bytes


def sharded_bytes(tensors, world_size, trainer_bytes=0, main=True):
    """(the whole checkpoint's bytes, this rank's) of a sharded checkpoint (fsdp: DCP) of
    `tensors` (tensor_bytes(..., once=False)) over `world_size` ranks, rank 0 (`main`) writing
    the trainer's state too (trainer.pt). Each rank writes a record per shard it holds, and one
    rank each plain tensor (DCP's deduplication; counted on every rank as its own: a little over)."""
    records = tensors.sharded * world_size + tensors.count - tensors.sharded + tensors.values
    whole = tensors.whole + records * SHARD_TENSOR_BYTES + trainer_bytes
    return whole, tensors.local + tensors.count * SHARD_TENSOR_BYTES + (trainer_bytes if main else 0)


# --- the folder ---------------------------------------------------------------------------


def existing(folder):
    """`folder`, or its nearest ancestor that exists: the file system it is (or will be) on."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(folder):
    """Free bytes of `folder`'s file system, as far as this process may use them."""
    return shutil.disk_usage(existing(folder)).free


def held_bytes(folder):
    """What the checkpoints in `folder` take now (numbered files and folders, and last.pt where it
    is not a second name of one of them): a run replaces them as it saves new ones."""
    folder = Path(folder)
    seen, total = set(), 0
    for path in [*folder.glob("step_*"), folder / "last.pt"]:
        files = sorted(path.rglob("*")) if path.is_dir() and not path.is_symlink() else [path]
        for file in files:
            try:
                stat = file.lstat()
            except OSError:  # pruned meanwhile, or not there
                continue
            if (stat.st_dev, stat.st_ino) not in seen and file.is_file() and not file.is_symlink():
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


@dataclass
class Space:
    """One checkpoint of `checkpoint` bytes (every rank's part together) and the room for them:
    the folder, --keep_checkpoints, what its checkpoints hold now, and its free space."""

    folder: Path
    checkpoint: int
    keep: int
    held: int
    free: int

    @property
    def kept(self):
        """Checkpoints kept between saves: --keep_checkpoints, and at least `last` (ddp's last.pt
        is a hard link to the newest numbered file, fsdp's `last` a symbolic link: no room)."""
        return max(self.keep, 1)

    @property
    def peak(self):
        """The most the run's checkpoints take at once: the kept ones and the one being written
        (older ones are pruned only once it is complete)."""
        return (self.kept + 1) * self.checkpoint

    @property
    def needed(self):
        """Free bytes the run needs: the peak less what the checkpoints there now hold (replaced
        as it saves), and at least one checkpoint (older ones go only after the next is saved)."""
        return max(self.checkpoint, self.peak - self.held)

    def numbers(self, held=True):
        held = f", less the {size_text(self.held)} its checkpoints hold now" if held and self.held else ""
        return (
            f"{size_text(self.free)} free, a checkpoint needs about {size_text(self.checkpoint)}, and "
            f"--keep_checkpoints {self.keep} keeps up to {size_text(self.peak)} at once ({self.kept} kept and the "
            f"one being written{held})"
        )

    def fix(self):
        """What makes room: the --keep_checkpoints that fits, where one does, and the other ways."""
        fitting = (self.free + self.held) // max(self.checkpoint, 1) - 1
        lower = f"pass --keep_checkpoints {fitting}, or" if 1 <= fitting < self.keep else "or pass"
        return f"free space there, {lower} an --output_dir on a file system with room"

    def shortfall(self):
        """The one line that says the checkpoints will not fit (None: they do)."""
        if self.free >= self.needed:
            return None
        return f"not enough space for checkpoints in {self.folder}: {self.numbers()}; {self.fix()}"

    def summary(self):
        return f"{self.folder}: {self.numbers()}"


def space(folder, checkpoint, keep):
    """The Space of `folder` for checkpoints of `checkpoint` bytes, --keep_checkpoints `keep`."""
    return Space(Path(folder), checkpoint, keep, held_bytes(folder), free_bytes(folder))


# --- a failed save ------------------------------------------------------------------------


def out_of_space(error, folder, needed):
    """What `error`, raised writing `needed` bytes into `folder`, says of the disk: "no space left
    on device", "disk quota exceeded", or None (another failure). By the errno it carries (in
    its chain, or in DCP's failures of each rank); torch.save's zip writer keeps none of a failed
    write to a path ("unexpected pos"), which a free space below `needed` tells instead."""
    todo, seen, other = [error], set(), False
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, tuple):  # DCP: (exception, traceback)
            todo += [part for part in item if isinstance(part, BaseException)]
        if not isinstance(item, BaseException):  # a rank's message alone
            continue
        if isinstance(item, OSError) and item.errno in SPACE_ERRNOS:
            return SPACE_ERRNOS[item.errno]
        other = other or isinstance(item, OSError)
        todo += [item.__cause__, item.__context__, *getattr(item, "failures", {}).values()]
    if not other and free_bytes(folder) < needed:
        return SPACE_ERRNOS[errno.ENOSPC]
    return None


def save_failure(folder, step, error, checkpoint, keep):
    """The one line of a checkpoint of `checkpoint` bytes, step `step`, that could not be written
    into `folder`: in plain words with the numbers and what to do when the disk is full."""
    try:
        reason = out_of_space(error, folder, checkpoint)
        room = space(folder, checkpoint, keep) if reason else None
    except OSError:  # the folder cannot even be read: the error as it came, not a second one
        reason = None
    if reason is None:
        return f"could not write the checkpoint of step {step} to {folder}: {first_line(error)}"
    return (
        f"{reason} in {folder}: {room.numbers(held=False)}; the checkpoint of step {step} is not saved and the ones "
        f"before it are untouched: {room.fix()}, then run the same command to resume"
    )
