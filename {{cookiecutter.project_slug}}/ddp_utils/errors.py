"""Every error the machinery raises on purpose, in one place; what each means for the run.

The one-line errors (exit status 2, nothing written): `InputError` and `ConfigError`, printed by
`core.logs.print_error`. The errors every rank agrees on (reported once, no traceback):
`TrainingError`, `CheckpointError`. The rest name one rank's trouble or one component's.
"""

import signal


class InputError(ValueError):
    """Bad settings or data, found before training starts: reported as one line, `error: ...`,
    exit status 2, with nothing written (train.py checks the data before it creates output_dir)."""


class ConfigError(InputError):
    """A bad value: `ConfigError("lr", "must be greater than 0")` reads "--lr must be greater than 0"."""

    def __init__(self, name, problem):
        super().__init__(f"--{name} {problem}")
        self.field, self.problem = name, problem


class TrainingError(RuntimeError):
    """An error every rank agrees on; reported once, without a traceback."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read, or ranks that waited too long for one."""


class DeviceError(RuntimeError):
    """GPUs were asked for and CUDA cannot use them: the job must not train on the CPU instead.
    Each node finds this alone (a broken driver may be on one node only): its line names the node."""


class RankGone(RuntimeError):
    """Another rank died while this one waited for it in the store (store_waits.Heartbeats)."""


class OutOfMemory(RuntimeError):
    """This rank ran out of GPU memory (out_of_memory.MemoryGuard): the line that names it."""


class DataUnavailable(RuntimeError):
    """The data's store failed mid-run (unreachable, a shard missing or corrupt: data/shards.py):
    one line naming the shard; the run stops as at an out-of-memory error, and the same command
    resumes from its last checkpoint.

    Raised in a DataLoader worker, it reaches the training process as DataLoader re-raises it:
    `DataUnavailable(text with the worker's traceback)`, whose last line is the original message."""

    def __init__(self, message):
        if message.startswith("Caught "):  # torch.utils.data's ExceptionWrapper.reraise
            name, _, text = message.rstrip().splitlines()[-1].partition(": ")  # "package.module.Class: message"
            message = text if name.endswith(type(self).__name__) else message
        super().__init__(message)


class Preempted(Exception):
    """A stop signal (faults.StopRequest) reached every rank: checkpoint and exit."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class FolderLost(Exception):
    """The output folder is another run's now (folder_claim): nothing more may be written there."""


class ClaimRefused(Exception):
    """Another run owns the folder."""


class PreflightError(RuntimeError):
    """A job that cannot train as launched: ranks, hosts, devices or the network (preflight)."""


class NotCounted(Exception):
    """Why a model's FLOPs cannot be counted (MFU is then not reported; training goes on)."""
