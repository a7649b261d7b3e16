import subprocess
import sys

import pytest
from conftest import PROJECT, run_training

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.errors import ConfigError

CONTRACT_FIELDS = "seed epochs batch_size lr num_workers amp grad_accum_steps output_dir resume".split()
CONTRACT_FIELDS += ["max_steps", "eval_every_steps", "train_samples", "val_samples"]


def test_contract_fields_exist():
    names = set(Config.__dataclass_fields__)
    assert set(CONTRACT_FIELDS) <= names


def test_help_lists_every_field():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=PROJECT, capture_output=True, text=True)
    assert result.returncode == 0
    for name in Config.__dataclass_fields__:
        assert f"--{name}" in result.stdout


def test_overrides_are_typed():
    args = ["--lr", "0.5", "--epochs", "3", "--find_unused_parameters", "true", "--amp", "fp16"]
    cfg = parse_config(Config, args, resolve=False)  # nothing read from the data
    assert (cfg.lr, cfg.epochs, cfg.find_unused_parameters, cfg.amp) == (0.5, 3, True, "fp16")
    assert parse_config(Config, ["--find_unused_parameters", "False"], resolve=False).find_unused_parameters is False


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Config().lr = 1.0


# Negative values are written `--flag=-1e-3`: argparse reads a separate "-1e-3" as a flag.
@pytest.mark.parametrize(
    "args, field, problem",
    [
        (["--batch_size", "0"], "batch_size", "must be at least 1"),
        (["--lr", "0"], "lr", "must be greater than 0"),
        (["--lr=-1e-3"], "lr", "must be greater than 0"),
        (["--amp", "fp8"], "amp", "invalid choice"),
        (["--epochs=-1"], "epochs", "must be at least 1"),
        (["--epochs", "two"], "epochs", "invalid int value"),
        (["--weight_decay=-1e-2"], "weight_decay", "must not be negative"),
        (["--min_lr_ratio=1.5"], "min_lr_ratio", "must be between 0 and 1"),
        (["--min_loss_scale=-1e-4"], "min_loss_scale", "must not be negative"),
        (["--max_skipped_steps=-1"], "max_skipped_steps", "must not be negative"),
        (["--checkpoint_timeout_seconds", "0"], "checkpoint_timeout_seconds", "must be at least 1"),
        (["--find_unused_parameters", "maybe"], "find_unused_parameters", "invalid bool value"),
        (["--static_graph", "true", "--grad_accum_steps", "2"], "static_graph", "--grad_accum_steps > 1"),
        (["--comm_hook", "powersgd", "--amp", "fp16"], "comm_hook", "cannot run with --amp fp16"),
        (["--strategy", "zero3"], "strategy", "invalid choice"),
        (["--strategy", "fsdp", "--amp", "fp16"], "amp", "use --amp bf16"),
        (["--strategy", "fsdp", "--comm_hook", "bf16"], "comm_hook", "is a DDP setting"),
        (["--strategy", "fsdp", "--find_unused_parameters", "true"], "find_unused_parameters", "is a DDP setting"),
        (["--async_checkpoint", "true"], "async_checkpoint", "needs --strategy fsdp"),
        (["--no_such_field", "1"], "no_such_field", "unrecognized arguments"),
    ],
)
def test_bad_values_exit_with_one_line_naming_the_field(args, field, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Config, args, resolve=False)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--{field}" in err and problem in err, err


@pytest.mark.parametrize(
    "values, field",
    [
        ({"lr": -1e-3}, "lr"),
        ({"epochs": -1}, "epochs"),
        ({"weight_decay": -0.01}, "weight_decay"),
        ({"min_loss_scale": -1.0}, "min_loss_scale"),
        ({"static_graph": True, "grad_accum_steps": 2}, "static_graph"),
        ({"comm_hook": "powersgd", "amp": "fp16"}, "comm_hook"),
        ({"strategy": "fsdp", "static_graph": True}, "static_graph"),
    ],
)
def test_bad_values_are_refused_by_config_itself(values, field):
    """The same checks hold for code that builds a Config directly (sweeps, tests)."""
    with pytest.raises(ConfigError) as error:
        Config(**values)
    assert error.value.field == field and str(error.value).startswith(f"--{field} ")


def test_bad_value_under_torchrun_is_reported_once(tmp_path):
    """Even when rank 0 gets there last: the other ranks wait for it to report the problem
    (exiting first, they would have torchrun stop rank 0 before it printed anything)."""
    result = run_training(tmp_path, "--batch_size", "0", nproc=2, probe="late_rank0", check=False)
    assert result.returncode != 0
    assert result.stderr.count("--batch_size must be at least 1") == 1, result.stderr
    assert (
        'train.py", line' not in result.stderr and 'trainer.py", line' not in result.stderr
    )  # torchrun's own summary may follow, no rank's traceback


@pytest.mark.parametrize(
    ("entry_point", "arguments"),
    [("train.py", []), ("doctor.py", []), ("preflight.py", []), ("export.py", ["a.pt", "out.pt"]),
     ("sweep.py", ["sweep.toml"])],
)  # fmt: skip
def test_every_entry_point_refuses_a_bad_flag_in_one_line(entry_point, arguments):
    """An unknown flag, or a missing argument, ends every entry point the same way: one line,
    `error: ...` naming the culprit, exit status 2, no usage block nor traceback."""
    for args in ([*arguments, "--no_such_flag"], [] if arguments else None):
        if args is None:
            continue  # an entry point that needs no argument
        done = subprocess.run([sys.executable, entry_point, *args], cwd=PROJECT, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (entry_point, done.stderr)
        assert "--no_such_flag" in lines[0] if args else "required" in lines[0] or "give" in lines[0], lines[0]
