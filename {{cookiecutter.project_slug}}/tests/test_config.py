import subprocess
import sys

import pytest
from conftest import PROJECT, run_training

from config import Config, parse_config

CONTRACT_FIELDS = (
    "seed epochs batch_size lr num_workers amp grad_accum_steps output_dir resume "
    "train_samples val_samples input_dim hidden_dim num_classes"
).split()


def test_contract_fields_exist():
    names = set(Config.__dataclass_fields__)
    assert set(CONTRACT_FIELDS) <= names


def test_help_lists_every_field():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=PROJECT, capture_output=True, text=True)
    assert result.returncode == 0
    for name in Config.__dataclass_fields__:
        assert f"--{name}" in result.stdout


def test_overrides_are_typed():
    cfg = parse_config(["--lr", "0.5", "--epochs", "3", "--find_unused_parameters", "true", "--amp", "fp16"])
    assert (cfg.lr, cfg.epochs, cfg.find_unused_parameters, cfg.amp) == (0.5, 3, True, "fp16")
    assert parse_config(["--find_unused_parameters", "False"]).find_unused_parameters is False


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Config().lr = 1.0


@pytest.mark.parametrize(
    "args, field",
    [
        (["--batch_size", "0"], "batch_size"),
        (["--lr", "0"], "lr"),
        (["--lr", "-1e-3"], "lr"),
        (["--amp", "fp8"], "amp"),
        (["--epochs", "-1"], "epochs"),
        (["--epochs", "two"], "epochs"),
        (["--find_unused_parameters", "maybe"], "find_unused_parameters"),
        (["--no_such_field", "1"], "no_such_field"),
    ],
)
def test_bad_values_exit_with_one_line_naming_the_field(args, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--{field}" in err


def test_bad_value_under_torchrun_is_reported_once(tmp_path):
    result = run_training(tmp_path, "--batch_size", "0", nproc=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count("--batch_size must be at least 1") == 1, result.stderr
    assert 'train.py", line' not in result.stderr  # torchrun's own summary may follow, no rank's traceback
