"""What must hold before a run writes anything: the task, its datasets (read, split, scanned for
bad samples) and the trackers' packages, agreed by every rank (train.py's `run` calls it first)."""

from .contract import load_task
from .data import build_datasets
from .dist import agree
from .knobs import InputError
from .logs import rank_zero_only
from .trackers import missing_package


def check_inputs(cfg, ctx):
    """The task, its datasets and notes about them, once the data and the trackers' packages
    are known to be usable; else an InputError on every rank, before anything is written."""
    task = load_task()  # model.py's and dataset.py's functions (ddp_utils/contract.py)
    datasets, notes = build_datasets(task, cfg, ctx)
    if cfg.sample_every_steps and task.sample_text is None:
        raise InputError("--sample_every_steps: this task's model.py has no sample_text(model, cfg)")
    # Only rank 0 imports the trackers' packages; a missing one stops every rank at once.
    missing = rank_zero_only(missing_package)(cfg.trackers)
    agree(ctx, "trackers_installed", missing, cfg.timeout_seconds, InputError)
    return task, datasets, notes
