"""How a config field is declared: `knob()`, and the one-line error for a bad value or bad data.

config.py, model.py and dataset.py all declare their fields this way; Config joins them. The
task's scripts parse their flags with `OneLineParser` too, and end on a bad input with
`exit_with_error` (core.logs: `error: ...`, exit status 2). The errors themselves live in
errors.py; the names below stay importable from here for the files of projects made before.
"""

import argparse
from dataclasses import field

from .core.logs import exit_with_error, print_error
from .errors import ConfigError, InputError

__all__ = ["ConfigError", "InputError", "OneLineParser", "exit_with_error", "knob", "print_error"]


def knob(default, help, choices=None, aliases=None):
    """A config field with its help text (and allowed values) for --help and docs/configuration.md.
    `aliases`: other spellings a flag or a TOML file may give, each read as the value it names
    (a knob's former values, so that the commands and files of projects made before still work)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases or {}})


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, printed once rather than once per rank."""

    def error(self, message):
        exit_with_error(message)
