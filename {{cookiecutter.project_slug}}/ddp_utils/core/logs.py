"""Rank-aware logging: rank 0 speaks for the job, every rank reports its own failures.

`rank_zero_only` checks the *global* rank; code under it never calls a collective, which would
hang the other ranks.
"""

import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from .files import folder_lost

log = logging.getLogger("train")


def launch_rank(environ=os.environ):
    """This process's global rank as the launcher set it (torchrun's RANK, else SLURM's
    SLURM_PROCID, else 0), readable before the process group exists."""
    return int(environ.get("RANK", environ.get("SLURM_PROCID", 0)))


def launch_local_rank(environ=os.environ):
    """This process's rank on its node as the launcher set it (LOCAL_RANK, SLURM_LOCALID, 0)."""
    return int(environ.get("LOCAL_RANK", environ.get("SLURM_LOCALID", 0)))


def global_rank():
    if dist.is_initialized():
        return dist.get_rank()
    return launch_rank()


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
        train_log = logging.FileHandler(Path(output_dir) / "train.log")
        # No line once the folder is another run's (folder_claim): train.log is the new owner's.
        train_log.addFilter(lambda record: folder_lost() is None)
        handlers.append(train_log)
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    return log


def stop_file_logging():
    """Log to the console only from now on (the output folder is no longer this run's)."""
    for handler in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        # Called from the claim's heartbeat thread too: a line being logged meanwhile is
        # dropped (a closed FileHandler in mode "a" would open its file again to write it).
        handler.addFilter(lambda record: False)
        log.removeHandler(handler)
        handler.close()


@rank_zero_only
def warn_main(message):
    log.warning(message)


@rank_zero_only
def report(message, *args, level=logging.INFO):
    log.log(level, message, *args)


def exit_with_error(message):
    """Print `error: <message>` and exit with status 2. Every rank parses the command line; only
    the first prints, all exit."""
    print_error(message)
    sys.exit(2)


def print_error(message):
    """`error: <message>` on stderr, from the first process only: the one format of every bad
    setting or data (exit status 2). The other processes find the same problem and wait here
    for the first to report it: had one of them exited first, torchrun would stop the first
    process, maybe before it printed (seen under load: no error line at all). torchrun stops
    them as soon as the first exits; one still running after ERROR_WAIT_SECONDS found a
    problem the first did not (data missing on its node only) and reports it itself."""
    rank = launch_rank()
    print_from_first(f"error: {message}", rank == 0, f"error: rank {rank}: {message}")


def print_from_first(line, first, late_line):
    """`line` on stderr from the first process; the others wait ERROR_WAIT_SECONDS (torchrun
    stops them sooner, once the first has exited) and print `late_line` if still running."""
    if not first:
        time.sleep(ERROR_WAIT_SECONDS)
    print(line if first else late_line, file=sys.stderr, flush=True)


ERROR_WAIT_SECONDS = 30


def first_line(error, limit=None):
    """The first line of `error`'s message, or of the first failure DCP gathered from the ranks; its
    type's name when it says nothing; at most `limit` characters."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        failure = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(failure).__name__}: {first_line(failure)}"[:limit]
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]
