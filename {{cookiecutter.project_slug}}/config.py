"""Every knob of a training run, in one place.

Edit the defaults here, or override any field on the command line:

    python train.py --epochs 3 --lr 0.001 --amp none

`python train.py --help` lists every field. Field names are a stable contract: scripts,
sweeps and the checkpoint's saved config refer to them by name.
"""

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field


def knob(default, help, choices=None):
    """A config field with its help text (and allowed values) for --help and the README."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Config:
    # Run
    seed: int = knob(0, "seed of everything random: model init, data order, augmentation")
    epochs: int = knob(10, "passes over the training set")
    output_dir: str = knob("runs/default", "folder for train.log, metrics.jsonl and checkpoints/")
    resume: str = knob(
        "auto",
        "'auto': continue from output_dir/checkpoints/last.pt if present, 'none': start fresh, or a checkpoint path",
    )

    # Data (see dataset.py to plug in your own)
    dataset: str = knob("synthetic", "which dataset build_datasets returns", ("synthetic", "blobs"))
    train_samples: int = knob(16384, "training samples")
    val_samples: int = knob(2048, "validation samples (all of them are evaluated, once)")
    input_dim: int = knob(32, "features per sample")
    num_classes: int = knob(4, "classes")
    input_noise_std: float = knob(0.0, "std of Gaussian noise added to training inputs, 0 = off")
    num_workers: int = knob(0, "DataLoader worker processes per training process")
    persistent_workers: bool = knob(True, "keep DataLoader workers alive across epochs (with num_workers > 0)")
    prefetch_factor: int = knob(2, "batches each DataLoader worker loads ahead (with num_workers > 0)")

    # Model
    hidden_dim: int = knob(256, "width of the two hidden layers")

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
    progress_bar: bool = knob(True, "tqdm progress bar on rank 0 when stdout is a terminal")
    tensorboard: bool = knob(False, "also log to output_dir/tensorboard (needs the tensorboard package)")
    peak_tflops: float = knob(0.0, "peak TFLOPS of one GPU for the MFU estimate, 0 = look up the GPU")

    # Distributed
    timeout_seconds: int = knob(600, "limit for process-group start-up and each collective")
    find_unused_parameters: bool = knob(
        False, "let DDP handle parameters that get no gradient in a step (slower; see README)"
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}")
        positive = ("epochs", "train_samples", "val_samples", "input_dim", "hidden_dim")
        positive += ("batch_size", "grad_accum_steps", "timeout_seconds", "prefetch_factor", "bucket_cap_mb")
        positive += ("checkpoint_timeout_seconds",)
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        non_negative = ("num_workers", "input_noise_std", "weight_decay", "max_grad_norm")
        non_negative += ("warmup_steps", "checkpoint_every_steps", "keep_checkpoints", "log_every_steps", "peak_tflops")
        non_negative += ("min_loss_scale", "max_skipped_steps")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if self.num_classes < 2:
            raise ConfigError("num_classes", "must be at least 2")
        if not self.lr > 0:
            raise ConfigError("lr", "must be greater than 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", "must be between 0 and 1")
        if not self.output_dir:
            raise ConfigError("output_dir", "must not be empty")
        if self.static_graph and self.grad_accum_steps > 1:
            # DDP's static graph expects an all-reduce after every backward; no_sync() breaks that
            # (an internal assert, or with PyTorch's patch, gradients that silently stop syncing).
            raise ConfigError("static_graph", "cannot be combined with --grad_accum_steps > 1: set one of them back")
        if self.comm_hook == "powersgd" and self.amp == "fp16":
            # One overflowing fp16 step puts inf into PowerSGD's error feedback for good: every
            # later step overflows and is skipped.
            raise ConfigError("comm_hook", "powersgd cannot run with --amp fp16: use --amp bf16, or --comm_hook fp16")

    def to_dict(self):
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    def __init__(self, name, problem):
        super().__init__(f"--{name} {problem}")
        self.field = name


def _parse_bool(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise ValueError(text)


_parse_bool.__name__ = "bool"  # argparse names the type in its error: "invalid bool value"


class _OneRankParser(argparse.ArgumentParser):
    """An argument parser that reports errors from one process only, not once per rank."""

    def error(self, message):
        exit_with_error(message)


def exit_with_error(message):
    # Every rank parses the command line; only the first prints, all exit.
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser():
    parser = _OneRankParser(
        description="Train a model with PyTorch DDP. Every Config field is a flag.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Config):
        parser.add_argument(
            f"--{f.name}",
            type=_parse_bool if f.type is bool else f.type,
            default=f.default,
            choices=f.metadata["choices"],
            metavar="true|false" if f.type is bool else None,
            help=f.metadata["help"],
        )
    return parser


def parse_config(argv=None):
    """Build the Config from the defaults above and `--field value` overrides."""
    args = build_parser().parse_args(argv)
    try:
        return Config(**vars(args))
    except ConfigError as error:
        exit_with_error(str(error))
