"""How a config field is declared: `knob()`, and the one-line error for a bad value.

config.py, model.py and dataset.py all declare their fields this way; Config joins them. The
task's scripts parse their flags with `OneLineParser` too.
"""

import argparse
import os
import sys
from dataclasses import field


def knob(default, help, choices=None):
    """A config field with its help text (and allowed values) for --help and the README."""
    return field(default=default, metadata={"help": help, "choices": choices})


class ConfigError(ValueError):
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
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
