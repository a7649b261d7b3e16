"""Rank-aware logging: rank 0 speaks for the job, every rank reports its own failures.

`rank_zero_only` checks the *global* rank; code under it never calls a collective, which would
hang the other ranks.
"""

import functools
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger("train")


def global_rank():
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def rank_zero_only(fn):
    """Run `fn` on global rank 0 only; elsewhere it returns None. Never put collectives in `fn`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if global_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper


def setup_logging(ctx, output_dir):
    """Rank 0 logs INFO to the console and output_dir/train.log; other ranks WARNING and up."""
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if ctx.is_main else logging.WARNING)
    formatter = logging.Formatter(f"%(asctime)s [rank {ctx.rank}] %(levelname)s %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout)]
    Path(output_dir).mkdir(parents=True, exist_ok=True)  # on every rank: a failure stops them all alike
    if ctx.is_main:
        handlers.append(logging.FileHandler(Path(output_dir) / "train.log"))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    return log


def stop_file_logging():
    """Log to the console only from now on (the output folder is no longer this run's)."""
    for handler in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(handler)
        handler.close()


@rank_zero_only
def warn_main(message):
    log.warning(message)


@rank_zero_only
def report(message, *args, level=logging.INFO):
    log.log(level, message, *args)
