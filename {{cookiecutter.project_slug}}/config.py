"""Every knob of a training run, in one place: the fields below, plus the model's
(ModelConfig in model.py) and the data's (DataConfig in dataset.py), which live next to the
code they configure.

Edit the defaults there, keep an experiment's settings in a TOML file, or override any field
on the command line; the last wins (defaults, then the file, then the flags):

    python train.py --config experiments/quick_cpu.toml --lr 0.001

`python train.py --help` lists every field. Field names are a stable contract: config files,
scripts, sweeps and the checkpoint's saved config refer to them by name. Each run writes its
resolved config to output_dir/config.toml, which reproduces it.
"""

import argparse
import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from dataset import DataConfig
from ddp_utils.checkpoint_files import write_atomically
from ddp_utils.knobs import ConfigError, OneLineParser, exit_with_error, knob
from ddp_utils.trackers import TRACKERS
from model import ModelConfig


@dataclass(frozen=True)
class Config(ModelConfig, DataConfig):
    # Run
    seed: int = knob(0, "seed of everything random: model init, data order, augmentation")
    epochs: int = knob(10, "passes over the training set (when max_steps is 0)")
    max_steps: int = knob(0, "optimizer steps to train, across epochs; 0 = train epochs")
    eval_every_steps: int = knob(0, "evaluate (one metrics.jsonl line) every N optimizer steps, 0 = at epoch ends")
    output_dir: str = knob("runs/default", "folder for train.log, metrics.jsonl and checkpoints/")
    resume: str = knob(
        "auto",
        "'auto': continue from output_dir/checkpoints/last.pt if present, 'none': start fresh, or a checkpoint path",
    )

    # Data loading (the data itself: DataConfig in dataset.py)
    num_workers: int = knob(0, "DataLoader worker processes per training process")
    persistent_workers: bool = knob(
        True, "keep DataLoader workers alive across epochs and evaluations, started before training (num_workers > 0)"
    )
    prefetch_factor: int = knob(2, "batches each DataLoader worker loads ahead (with num_workers > 0)")
    skip_bad_files: bool = knob(
        False, "train without the samples the data's check finds bad (a corrupt image), rather than stop"
    )

    # Optimisation
    batch_size: int = knob(
        64, "samples per process per micro-step; global batch = batch_size x processes x grad_accum_steps"
    )
    grad_accum_steps: int = knob(1, "micro-steps per optimizer step")
    lr: float = knob(1e-3, "peak learning rate, used as given (never rescaled by the world size)")
    weight_decay: float = knob(0.01, "AdamW weight decay")
    max_grad_norm: float = knob(1.0, "clip the global gradient norm to this, 0 = off")
    lr_schedule: str = knob("cosine", "learning-rate decay after warmup", ("cosine", "constant"))
    warmup_steps: int = knob(0, "optimizer steps of linear warmup from 0 to lr (at the run's first global batch)")
    min_lr_ratio: float = knob(0.1, "cosine decays to lr x this at the last step")
    min_loss_scale: float = knob(1.0, "fp16: stop when the loss scale falls below this")
    max_skipped_steps: int = knob(20, "fp16: stop after this many overflow-skipped steps in a row, 0 = never")
    amp: str = knob(
        {{ cookiecutter.amp | tojson }},
        "mixed precision: bf16 or fp16 autocast (fp16 with loss scaling), or none",
        ("bf16", "fp16", "none"),
    )

    # Speed
    compile: bool = knob(False, "torch.compile the DDP-wrapped model (PyTorch's documented order)")
    tf32: bool = knob(True, "allow TF32 matmuls and convolutions on GPUs that have them")
    gradient_as_bucket_view: bool = knob(True, "gradients as views of DDP's buckets: saves a copy and memory")
    static_graph: bool = knob(False, "tell DDP the graph is the same every step (enables more overlap)")
    bucket_cap_mb: int = knob(25, "size of DDP's gradient buckets in MiB")
    comm_hook: str = knob(
        "none",
        "compress gradients before all-reduce, for slow inter-node links",
        ("none", "bf16", "fp16", "powersgd"),
    )

    # Checkpoints and logging
    checkpoint_every_steps: int = knob(0, "also checkpoint every N optimizer steps, 0 = epoch ends only")
    checkpoint_timeout_seconds: int = knob(
        1800, "limit for writing or reading a checkpoint while the other ranks wait (slow network file systems)"
    )
    keep_checkpoints: int = knob(3, "newest step checkpoints kept besides last.pt")
    log_every_steps: int = knob(50, "log the training loss every N optimizer steps, 0 = off")
    sample_every_steps: int = knob(0, "rank 0 logs a sample of the model's output every N steps (sample_text), 0 = off")
    progress_bar: bool = knob(True, "tqdm progress bar on rank 0 when stdout is a terminal")
    tracker: str = knob(
        "none",
        "where metrics also go, from rank 0: none, tensorboard (output_dir/tensorboard), wandb, mlflow, "
        "or a comma list such as tensorboard,wandb (README: Experiment trackers)",
    )
    tracker_project: str = knob({{ cookiecutter.project_slug | tojson }}, "W&B project and MLflow experiment of the run")
    profile_steps: str = knob(
        "", "record optimizer steps A:B (e.g. 10:12) on rank 0 with torch.profiler into output_dir/profile/, '' = off"
    )
    peak_tflops: float = knob(0.0, "peak TFLOPS of one GPU for the MFU estimate, 0 = look up the GPU")

    # Distributed
    strategy: str = knob(
        "ddp",
        "ddp: a whole copy of the model per process; fsdp: each process keeps 1/N of the parameters, "
        "gradients and optimizer state (README: When the model no longer fits)",
        ("ddp", "fsdp"),
    )
    replicate_degree: int = knob(
        0,
        "fsdp: keep N replicas, each sharded over world size / N processes (hybrid sharding, HSDP): all-gathers "
        "stay within a replica, only gradients cross between them; 0 = one replica per node, 1 = shard over all",
    )
    reshard_after_forward: bool = knob(
        True, "fsdp: free each block's gathered parameters after its forward (less memory, one more all-gather)"
    )
    init_on_meta: bool = knob(False, "build the model on the meta device, then initialise it module by module")
    async_checkpoint: bool = knob(False, "fsdp: write checkpoints in the background while training goes on")
    device: str = knob(
        "auto",
        "auto: each process's GPU when CUDA works, else the CPU, but stop when GPUs were asked for "
        "(CUDA_VISIBLE_DEVICES, SLURM) and CUDA cannot use them; cuda: stop without a usable GPU; cpu: the CPU",
        ("auto", "cuda", "cpu"),
    )
    timeout_seconds: int = knob(600, "limit for process-group start-up and each collective")
    find_unused_parameters: bool = knob(
        False, "let DDP handle parameters that get no gradient in a step (slower; see README)"
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}")
            if f.type is float and not math.isfinite(getattr(self, f.name)):  # nan passes every comparison
                raise ConfigError(f.name, "must be a finite number")
        positive = ("epochs", "batch_size", "grad_accum_steps", "timeout_seconds", "prefetch_factor", "bucket_cap_mb")
        positive += ("checkpoint_timeout_seconds",)
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        non_negative = ("num_workers", "weight_decay", "max_grad_norm", "max_steps", "eval_every_steps")
        non_negative += ("warmup_steps", "checkpoint_every_steps", "keep_checkpoints", "log_every_steps", "peak_tflops")
        non_negative += ("min_loss_scale", "max_skipped_steps", "replicate_degree", "sample_every_steps")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if not self.lr > 0:
            raise ConfigError("lr", "must be greater than 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", "must be between 0 and 1")
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
        self.check_model()
        self.check_data()

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
        return dataclasses.replace(self, **self.resolve_data(), **self.resolve_model())

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


def build_parser():
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
    for f in dataclasses.fields(Config):
        parser.add_argument(
            f"--{f.name}",
            type=_parse_bool if f.type is bool else f.type,
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


def read_config_file(path):
    """The fields a TOML file sets, type-checked; exits with one line naming the file (and every
    bad key) for a file that cannot be read or parsed, unknown keys or values of the wrong type."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as error:
        exit_with_error(f"--config {path}: cannot read it: {error.strerror or error}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        exit_with_error(f"--config {path}: not valid TOML: {error}")
    fields = {f.name: f for f in dataclasses.fields(Config)}
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


def parse_config(argv=None, resolve=True):
    """Build the Config from the defaults above, then `--config FILE.toml`, then `--field value`
    flags; with `resolve`, fill in what comes from the data (e.g. a vocabulary size of 0)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from_file = {}
    if args.config:
        from_file = read_config_file(args.config)
        parser.set_defaults(**from_file)
        args = parser.parse_args(argv)  # again: the flags win over the file
    values = {name: value for name, value in vars(args).items() if name != "config" and name not in RENAMED}
    try:
        cfg = Config(**values)
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
    except (OSError, UnicodeError) as error:
        return f"could not write {path}: {error}"
    return None
