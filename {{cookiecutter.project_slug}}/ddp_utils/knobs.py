"""How a config field is declared: `knob()`, and the one-line error for a bad value or bad data.

config.py, model.py and dataset.py all declare their fields this way; Config joins them. The
task's scripts parse their flags with `OneLineParser` too.
"""

import argparse
import os
import sys
import time
from dataclasses import field


def knob(default, help, choices=None):
    """A config field with its help text (and allowed values) for --help and docs/configuration.md."""
    return field(default=default, metadata={"help": help, "choices": choices})


class InputError(ValueError):
    """Bad settings or data, found before training starts: reported as one line, `error: ...`,
    exit status 2, with nothing written (train.py checks the data before it creates output_dir)."""


class ConfigError(InputError):
    """A bad value: `ConfigError("lr", "must be greater than 0")` reads "--lr must be greater than 0"."""

    def __init__(self, name, problem):
        super().__init__(f"--{name} {problem}")
        self.field, self.problem = name, problem


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, printed once rather than once per rank."""

    def error(self, message):
        exit_with_error(message)


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
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    print_from_first(f"error: {message}", rank == "0", f"error: rank {rank}: {message}")


def print_from_first(line, first, late_line):
    """`line` on stderr from the first process; the others wait ERROR_WAIT_SECONDS (torchrun
    stops them sooner, once the first has exited) and print `late_line` if still running."""
    if not first:
        time.sleep(ERROR_WAIT_SECONDS)
    print(line if first else late_line, file=sys.stderr, flush=True)


ERROR_WAIT_SECONDS = 30
