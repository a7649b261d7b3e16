"""What must hold before a run writes anything: the task, its datasets (read, split, scanned for
bad samples) and the trackers' packages, agreed by every rank (train/run.py calls it first, as does the preflight)."""

from ..contract import DATASET_HOOKS, near_misses
from ..core.logs import rank_zero_only
from ..data.loaders import checked_datasets
from ..distributed.store_waits import agree
from ..errors import InputError
from ..observe.trackers import missing_package


def check_inputs(task, cfg, ctx):
    """The task's datasets and notes about them, once the data and the trackers' packages are
    known to be usable; else an InputError on every rank, before anything is written."""
    datasets, notes = checked_datasets(task, cfg, ctx)
    notes += near_misses(datasets[0], DATASET_HOOKS, "the training set")
    if cfg.sample_every_steps and task.sample_text is None:
        raise InputError("--sample_every_steps: this task has no sample_text (task.py)")
    # Only rank 0 imports the trackers' packages; a missing one stops every rank at once.
    missing = rank_zero_only(missing_package)(cfg.trackers)
    agree(ctx, "trackers_installed", missing, cfg.timeout_seconds, InputError)
    return datasets, notes
