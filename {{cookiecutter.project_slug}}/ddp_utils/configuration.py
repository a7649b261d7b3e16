"""A run's config from config.py's defaults, a TOML file and the flags (the last wins), checked
as a whole; and written back as the TOML file that reproduces it.

    python train.py --config experiments/quick_cpu.toml --lr 0.001

config.py's Config declares the fields (with ModelConfig and DataConfig); RunConfig, its base,
holds what every config does: the checks across fields, the parser, the TOML round trip.
Field names are a stable contract: config files, scripts, sweeps and the checkpoint's saved
config refer to them by name.
"""

import argparse
import dataclasses
import difflib
import functools
import json
import math
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .contract import resolved
from .core.files import write_atomically
from .core.logs import exit_with_error
from .errors import ConfigError, FolderLost
from .knobs import OneLineParser
from .observe.trackers import TRACKERS


class RunConfig:
    """The base of config.py's Config: its checks (when built) and what it offers the loop.
    The checks are the run fields' own; ModelConfig's and DataConfig's `check_model()` and
    `check_data()` run after them, when they exist."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}")
            if f.type is float and not math.isfinite(getattr(self, f.name)):  # nan passes every comparison
                raise ConfigError(f.name, "must be a finite number")
        positive = ("epochs", "batch_size", "grad_accum_steps", "timeout_seconds", "prefetch_factor", "bucket_cap_mb")
        positive += ("checkpoint_timeout_seconds", "muon_ns_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        non_negative = ("num_workers", "weight_decay", "max_grad_norm", "max_steps", "eval_every_steps")
        non_negative += ("warmup_steps", "checkpoint_every_steps", "keep_checkpoints", "log_every_steps", "peak_tflops")
        non_negative += ("min_loss_scale", "max_skipped_steps", "replicate_degree", "sample_every_steps")
        non_negative += ("progress_every_seconds",)
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        for name in ("lr", "muon_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be greater than 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", "must be between 0 and 1")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError("muon_momentum", "must be at least 0 and less than 1")
        if not self.output_dir:
            raise ConfigError("output_dir", "must not be empty")
        if not set(self.trackers) <= set(TRACKERS):
            raise ConfigError("tracker", f"must be none, or one or more of {', '.join(TRACKERS)} joined by commas")
        self.profile_range()  # a bad range is refused now, not at step A
        if self.static_graph and self.grad_accum_steps > 1:
            # DDP's static graph expects an all-reduce after every backward; no_sync() breaks that
            # (an internal assert, or with PyTorch's patch, gradients that silently stop syncing).
            raise ConfigError("static_graph", "cannot be combined with --grad_accum_steps > 1: set one of them back")
        if self.comm_hook == "powersgd" and self.amp == "fp16":
            # One overflowing fp16 step puts inf into PowerSGD's error feedback for good: every
            # later step overflows and is skipped.
            raise ConfigError("comm_hook", "powersgd cannot run with --amp fp16: use --amp bf16, or --comm_hook fp16")
        if self.strategy == "fsdp":
            ddp_only = {"comm_hook": "none", "static_graph": "false", "find_unused_parameters": "false"}
            for name, default in ddp_only.items():
                if str(getattr(self, name)).lower() != default:
                    raise ConfigError(name, f"is a DDP setting: with --strategy fsdp leave it at {default}")
            if self.amp == "fp16":
                raise ConfigError("amp", "fp16 cannot run with --strategy fsdp: use --amp bf16 (no loss scaling)")
        elif self.async_checkpoint:
            raise ConfigError("async_checkpoint", "needs --strategy fsdp (ddp writes one file from rank 0)")
        elif self.replicate_degree:
            raise ConfigError("replicate_degree", "needs --strategy fsdp (ddp keeps a whole replica on every process)")
        elif self.cpu_offload:
            raise ConfigError("cpu_offload", "needs --strategy fsdp (ddp keeps the whole model state on every device)")
        for hook in ("check_model", "check_data"):  # ModelConfig's and DataConfig's own checks, if any
            if hasattr(self, hook):
                getattr(self, hook)()

    @property
    def trackers(self):
        """The trackers asked for, in order: () for none."""
        return () if self.tracker == "none" else tuple(dict.fromkeys(self.tracker.split(",")))

    def profile_range(self):
        """(first, last) optimizer step to profile, or None."""
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition(":")
        if not (re.fullmatch("[0-9]+", first) and re.fullmatch("[0-9]+", last) and 1 <= int(first) <= int(last)):
            raise ConfigError("profile_steps", "must be A:B with 1 <= A <= B, such as 10:12, or '' for off")
        return int(first), int(last)

    def resolved(self):
        """This config with the values read from the data filled in (e.g. a vocabulary size of 0)."""
        return resolved(self)

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_toml(self):
        """The config as a TOML file that `--config` reads back to this same config."""
        lines = [
            "# The resolved config of a run: config.py's defaults, then --config, then the flags.",
            "# Rerun it from scratch with: torchrun ... train.py --config <this file> --output_dir <a new folder>",
        ]
        lines += [f"{name} = {toml_value(value)}" for name, value in self.to_dict().items()]
        return "\n".join(lines) + "\n"


# Fields that are gone, and what replaced them: named in the error for a flag or a file key.
RENAMED = {"tensorboard": "was replaced by --tracker tensorboard"}


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # 1e-05 is TOML too (every float field is finite)
    # A TOML basic string is a JSON string, except that DEL must be escaped as well.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _parse_bool(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise ValueError(text)


_parse_bool.__name__ = "bool"  # argparse names the type in its error: "invalid bool value"


def unaliased(f, value):
    """`value` for field `f`, a former spelling (knob's `aliases`; a TOML true or false too) read
    as the value it names."""
    aliases = f.metadata.get("aliases") or {}
    key = toml_value(value) if isinstance(value, bool) else value
    return aliases.get(key.lower(), value) if isinstance(key, str) and aliases else value


def flag_type(f):
    """What argparse turns a flag's text into, for field `f`."""
    if f.type is bool:
        return _parse_bool
    if f.metadata.get("aliases"):
        return functools.wraps(f.type)(lambda text: unaliased(f, text))
    return f.type


def build_parser(config_class):
    parser = OneLineParser(
        description="Train a model with PyTorch DDP. Every Config field is a flag.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        action=ConfigFile,
        help="a TOML file of Config fields (flat, or in sections) over the defaults; flags win over it",
    )
    for name, replacement in RENAMED.items():
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS, action=Refuse, nargs="?", problem=replacement)
    for f in dataclasses.fields(config_class):
        parser.add_argument(
            f"--{f.name}",
            type=flag_type(f),
            default=f.default,
            choices=f.metadata["choices"],
            metavar="true|false" if f.type is bool else None,
            help=f.metadata["help"].replace("%", "%%"),  # argparse formats help with %
        )
    return parser


class Refuse(argparse.Action):
    """A flag that is gone: one line saying what replaced it."""

    def __init__(self, *args, problem, **kwargs):
        super().__init__(*args, **kwargs)
        self.problem = problem

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.problem}")


class ConfigFile(argparse.Action):
    """--config: one file, named."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:
            parser.error(f"{option_string} needs the path of a TOML file")
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} is given twice: put the settings of both files into one")
        setattr(namespace, self.dest, values)


def read_config_file(path, config_class):
    """The fields a TOML file sets, type-checked; exits with one line naming the file (and every
    bad key) for a file that cannot be read or parsed, unknown keys or values of the wrong type."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as error:
        exit_with_error(f"--config {path}: cannot read it: {error.strerror or error}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        exit_with_error(f"--config {path}: not valid TOML: {error}")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    values, where, problems = {}, {}, []
    for key, value in document.items():
        # A section ([optimisation], say) only groups fields: its keys are field names.
        if isinstance(value, dict) and key not in fields:
            entries = [(f"{key}.{name}", name, item) for name, item in value.items()]
        else:
            entries = [(key, key, value)]
        for place, name, item in entries:
            if name in RENAMED:
                problems.append(f"key {place} {RENAMED[name]}")
            elif name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f" (did you mean {close[0]}?)" if close else " (keys are Config fields: train.py --help)"
                problems.append(f"unknown key {place}{hint}")
            elif name in values:
                problems.append(f"key {place} is set twice (also as {where[name]})")
            else:
                item = unaliased(fields[name], item)
                values[name], where[name] = item, place
                problem = type_problem(place, item, fields[name].type)
                if problem:
                    problems.append(problem)
                elif fields[name].type is float:
                    values[name] = float(item)  # an integer where a number is wanted
    if problems:  # all of them at once: one edit fixes the file
        exit_with_error(f"--config {path}: {'; '.join(problems)}")
    return values


def type_problem(place, value, wanted):
    """Why `value` cannot be the field's type, or None: TOML's own types, no conversions but an
    integer where a float is wanted."""
    if wanted is float and isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, wanted) and not (wanted is int and isinstance(value, bool)):
        return None
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string in quotes"}
    return f"key {place} must be {kinds[wanted]}, not {value!r} ({type(value).__name__})"


def parse_config(config_class, argv=None, resolve=True):
    """Build the Config (config.py's class) from its defaults, then `--config FILE.toml`, then
    `--field value` flags; with `resolve`, fill in what comes from the data (e.g. a vocabulary
    size of 0)."""
    parser = build_parser(config_class)
    args = parser.parse_args(argv)
    from_file = {}
    if args.config:
        from_file = read_config_file(args.config, config_class)
        parser.set_defaults(**from_file)
        args = parser.parse_args(argv)  # again: the flags win over the file
    values = {name: value for name, value in vars(args).items() if name != "config" and name not in RENAMED}
    try:
        cfg = config_class(**values)
        return cfg.resolved() if resolve else cfg
    except ConfigError as error:
        if error.field in from_file and values[error.field] is from_file[error.field]:  # not overridden by a flag
            exit_with_error(f"--config {args.config}: key {error.field} {error.problem}")
        exit_with_error(str(error))


def write_resolved_config(cfg, output_dir):
    """output_dir/config.toml: this run's whole config, written whole or not at all. Returns an
    error, or None."""
    path = Path(output_dir) / "config.toml"
    try:
        write_atomically(path, lambda f: f.write(cfg.to_toml().encode()))
    except FolderLost as lost:
        return str(lost)
    except (OSError, UnicodeError) as error:
        return f"could not write {path}: {error}"
    return None
