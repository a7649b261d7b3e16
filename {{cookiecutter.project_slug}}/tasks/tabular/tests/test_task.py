"""The tabular task: your own table (CSV, Parquet) and its errors, predict.py, the synthetic
data, its model's FLOP count, and the worked example of a second dataset."""

import csv
import dataclasses
import functools
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import PROJECT, TINY, read_metrics, run_training, training_env
from task_settings import COLUMNS, table, write_table
from torch.utils.data import default_collate

from config import Config
from dataset import SyntheticClassification, build_datasets
from ddp_utils.configuration import parse_config
from ddp_utils.data import rows
from ddp_utils.data.loaders import build_loaders, start_epoch
from ddp_utils.observe import flops
from task import TASK

# The TINY run's flags without its table (tests/task_settings.py): the synthetic data.
TABLE_FLAGS = {"--data_file", "--target", "--ignore_columns"}
SYNTHETIC = [text for flag, value in zip(TINY[::2], TINY[1::2]) if flag not in TABLE_FLAGS for text in (flag, value)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 processes on the CSV table (TINY: tests/task_settings.py's table, text labels, unscaled features)."""
    output_dir = tmp_path_factory.mktemp("table") / "run"
    run_training(output_dir, "--epochs", "4", "--amp", "none", nproc=2)
    return output_dir


def test_a_csv_with_unscaled_features_and_text_labels_trains(trained):
    """Only standardised features let the model see the label's main cause (a feature of scale
    0.001 beside one of scale 1000): high accuracy shows the statistics are applied."""
    assert read_metrics(trained)[-1]["val_accuracy"] > 0.9
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    assert state["data"]["classes"] == ["high", "low", "mid"] and state["data"]["features"] == COLUMNS
    assert max(abs(m) for m in state["data"]["mean"]) > 1000  # of the raw training rows


def test_predict_prints_one_label_per_row(trained, tmp_path):
    rows = write_table(tmp_path / "rows.csv", rows=40, seed=7, label=False)
    command = [sys.executable, "predict.py", "--checkpoint", str(trained / "checkpoints" / "last.pt"),
               "--data_file", str(rows)]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    predicted = [line.split("\t")[0] for line in result.stdout.splitlines()]
    _, truth, _ = table(40, seed=7)
    assert len(predicted) == 40 and set(predicted) <= {"low", "mid", "high"}
    assert np.mean(np.array(predicted) == truth) > 0.8


def test_a_parquet_table_with_a_numeric_target_trains_as_regression(tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    features, grade, score = table(3000)
    columns = {name: features[:, i] for i, name in enumerate(COLUMNS)} | {"grade": grade, "score": score}
    path = tmp_path / "table.parquet"
    parquet.write_table(pyarrow.table(columns), path)
    run_training(tmp_path / "run", "--data_file", path, "--target", "score", "--ignore_columns", "grade",
                 "--epochs", "3")  # fmt: skip
    first, *_, last = read_metrics(tmp_path / "run")
    assert "val_accuracy" not in last and last["val_r2"] > 0.8, (first, last)


def bad_table(folder, case):
    """A table with one problem, and the text its error must name."""
    path = write_table(folder / "table.csv", rows=100)
    if case == "missing target column":
        return path, ["--target", "species"], "--target 'species' is not a column of"
    if case == "text in a feature column":
        lines = path.read_text().splitlines()
        cells = lines[5].split(",")
        lines[5] = ",".join(["Paris", *cells[1:]])
        path.write_text("\n".join(lines) + "\n")
        return path, [], "column 'income' holds text ('Paris') in data row 5"
    path.write_text("")
    return path, [], f"--data_file {path} is empty"


@pytest.mark.parametrize("case", ["missing target column", "text in a feature column", "empty file"])
def test_a_bad_table_is_one_line_naming_it_and_nothing_is_written(tmp_path, case):
    path, args, message = bad_table(tmp_path, case)
    result = run_training(tmp_path / "run", "--data_file", path, *args, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line and str(path) in line, line
    assert not (tmp_path / "run").exists()


def test_the_validation_split_is_a_function_of_the_rows_and_seed():
    """Each class's share held out, from --seed alone (no rank or world size goes in)."""
    flags = [*TINY, "--train_samples", "0", "--val_samples", "0"]
    a, val_a = build_datasets(parse_config(Config, flags))
    b, val_b = build_datasets(parse_config(Config, flags))
    _, val_c = build_datasets(parse_config(Config, [*flags, "--seed", "1"]))
    assert torch.equal(val_a.inputs, val_b.inputs) and torch.equal(a.inputs, b.inputs)
    assert not torch.equal(val_a.inputs, val_c.inputs)
    assert len(val_a) == 4000 and len(a) == 36000  # --val_fraction 0.1 of 40000 rows
    counts = torch.bincount(a.targets) + torch.bincount(val_a.targets)
    assert torch.bincount(val_a.targets).tolist() == [round(0.1 * count) for count in counts.tolist()]  # of each class


def numbered_table(path, far_off=()):
    """write_table's 400 rows with a first feature `row`, each row's number (a standardised row
    names itself: round(x * std + mean)), and the rows `far_off` moved far from the rest: every
    other feature and the score x 100 + 1e6 (their labels kept, so the split keeps them apart)."""
    features, grade, score = table(400)
    moved = np.zeros(len(score), dtype=bool)
    moved[list(far_off)] = True
    features = np.where(moved[:, None], features * 100 + 1e6, features)
    score = np.where(moved, score * 100 + 1e6, score)
    raw = np.column_stack([np.arange(len(score)), features])
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)  # repr of each float: read back bit for bit
        writer.writerow(["row", *COLUMNS, "grade", "score"])
        for values, text, number in zip(raw.tolist(), grade, score.tolist()):
            writer.writerow([*values, text, number])
    return path, raw, score


def row_numbers(rows):
    """The rows' numbers, in their order, from the standardised first feature."""
    state = rows.state
    return np.rint(rows.inputs[:, 0].double().numpy() * state["std"][0] + state["mean"][0]).astype(np.int64)


@pytest.mark.parametrize("target", [["grade", "score"], ["score", "grade"]], ids=["classes", "regression"])
def test_the_saved_statistics_are_the_training_rows_own(tmp_path, target):
    """The features' mean and std (and a regression target's) in data_state are the training
    rows' own, exactly: with the held-out rows moved a million away, statistics over every row
    (a leak into every prediction) would be far off, and the held-out rows stand far from 0."""

    def build(path):
        flags = [*SYNTHETIC, "--data_file", str(path), "--target", target[0], "--ignore_columns", target[1]]
        flags += ["--val_fraction", "0.25"]
        return build_datasets(parse_config(Config, [*flags, "--train_samples", "0", "--val_samples", "0"]))

    _, val = build(numbered_table(tmp_path / "plain.csv")[0])
    held_out = row_numbers(val)  # the split depends on the labels and --seed alone: the same below
    path, raw, score = numbered_table(tmp_path / "moved.csv", far_off=held_out)
    train, val = build(path)
    ours = row_numbers(train)  # in the order the training split holds them
    assert sorted([*ours, *row_numbers(val)]) == list(range(400)) and set(ours).isdisjoint(held_out)
    state = train.data_state()
    # Summed a chunk at a time (tables.Moments), in another order than NumPy's: equal to float64's rounding.
    close = functools.partial(np.testing.assert_allclose, rtol=1e-12, atol=0)
    close(state["mean"], raw[ours].mean(axis=0))
    close(state["std"], raw[ours].std(axis=0))
    assert abs(np.array(state["mean"][1:]) - raw.mean(axis=0)[1:]).min() > 1e4  # a leak would show
    assert val.data_state() is state and val.inputs[:, 1:].abs().min() > 1e3
    if target[0] == "score":
        close([state["target_mean"], state["target_std"]], [score[ours].mean(), score[ours].std()])
        assert abs(state["target_mean"] - score.mean()) > 1e4 and val.targets.abs().min() > 1e3


def test_dataset_is_deterministic_from_seed():
    a, _ = build_datasets(Config(seed=1).resolved())
    b, _ = build_datasets(Config(seed=1).resolved())
    c, _ = build_datasets(Config(seed=2).resolved())
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_persistent_workers_still_get_fresh_noise_every_epoch():
    cfg = Config(train_samples=64, batch_size=8, num_workers=2, persistent_workers=True, input_noise_std=1.0).resolved()
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    loader, _ = build_loaders(cfg, ctx, *build_datasets(cfg))
    assert isinstance(loader.dataset, SyntheticClassification)
    epochs = []
    for epoch in (0, 1, 0):
        start_epoch(loader, epoch, rank=0, seed=cfg.seed)
        order = list(loader.sampler)
        inputs = torch.cat([batch for batch, _ in loader])
        epochs.append(inputs[torch.argsort(torch.tensor(order))])  # by sample index
    assert not torch.allclose(epochs[0], epochs[1])
    assert torch.equal(epochs[0], epochs[2])  # the same epoch: the same noise


def test_input_noise_is_drawn_for_a_whole_batch_from_seed_epoch_and_index(monkeypatch):
    """A GPU would wait for the data otherwise: a batch's noise is one vectorised draw
    (gaussian_noise in ddp_utils/data/rows.py), not a generator and a hash per sample, and each
    sample's noise still depends on (seed, epoch, index) only: alone or in any batch, in any
    order, the same."""
    data = SyntheticClassification(512, 8, 4, seed=3, split="train", noise_std=1.0)
    data.set_epoch(2)
    draws, draw = [], rows.gaussian_noise
    monkeypatch.setattr(rows, "gaussian_noise", lambda *args: draws.append(args) or draw(*args))
    batch = data.__getitems__(list(range(256)))
    assert len(draws) == 1
    again = data.__getitems__([200, 3, 17])
    assert torch.equal(again[1][0], batch[3][0]) and torch.equal(data[17][0], batch[17][0])
    noise = torch.stack([inputs for inputs, _ in batch]) - data.inputs[:256]
    assert abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05  # standard normal
    data.set_epoch(3)
    assert not torch.allclose(data[17][0], batch[17][0])  # fresh noise every epoch


@pytest.mark.parametrize("dataset_name", ["synthetic", "blobs"])
def test_a_training_batch_is_the_datasets_one_gather_not_restacked_sample_by_sample(dataset_name):
    """A GPU would wait for the data otherwise: the training loader hands on the batch the
    dataset gathered with one index operation (the very tensors, no copy), instead of
    unbinding it into samples and stacking them again one at a time; and the batch holds
    exactly what the sample-by-sample path makes: the same samples in the same order, the
    same noise, the same dtypes, in the main process and in 2 worker processes."""
    noise = {"input_noise_std": 1.0} if dataset_name == "synthetic" else {}
    cfg = Config(dataset=dataset_name, train_samples=256, batch_size=64, **noise).resolved()
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    loader, _ = build_loaders(cfg, ctx, *build_datasets(cfg))
    data, gathered = loader.dataset, []
    if hasattr(data, "__getitems__"):  # DataLoader asks for a whole batch at once
        gather = data.__getitems__
        data.__getitems__ = lambda indices: gathered.append(gather(indices)) or gathered[-1]
    start_epoch(loader, 1, rank=0, seed=cfg.seed)
    batches = list(loader)
    assert len(batches) == len(gathered) == 4, "one gather per batch"
    memory = lambda tensor: tensor.untyped_storage().data_ptr()  # noqa: E731
    for batch, batch_gathered in zip(batches, gathered):  # a field of its first sample: a view of the gather
        assert [memory(t) for t in batch] == [memory(t) for t in batch_gathered[0]], "the batch was copied"
    vars(data).pop("__getitems__", None)
    order = list(loader.sampler)
    expected = [default_collate([data[index] for index in order[i : i + 64]]) for i in range(0, 256, 64)]
    for workers in (0, 2):
        cfg_workers = dataclasses.replace(cfg, num_workers=workers)
        loader, _ = build_loaders(cfg_workers, ctx, data, data)
        start_epoch(loader, 1, rank=0, seed=cfg.seed)
        for batch, wanted in zip(loader, expected, strict=True):
            assert type(batch) is type(wanted) and len(batch) == len(wanted)
            for mine, theirs in zip(batch, wanted):
                assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_flops_per_sample_are_counted_as_the_model_runs():
    """FlopCounterMode on a meta-device model: 2 FLOPs per weight forward, 2 for the weight
    gradient, 2 for the input gradient, except the first layer's (inputs need no gradient)."""
    cfg = Config(input_dim=8, hidden_dim=16, num_classes=4)
    weights = 8 * 16 + 16 * 16 + 16 * 4
    batch = (torch.zeros(1, 8), torch.tensor([1]))
    assert flops.flops_per_sample(cfg, TASK, batch) == 6 * weights - 2 * 8 * 16


def test_second_dataset_through_config(tmp_path):
    """docs/your-model.md's worked example: another dataset class, chosen with --dataset."""
    run_training(tmp_path, *SYNTHETIC, "--dataset", "blobs", "--epochs", "1", tiny=False)
    assert read_metrics(tmp_path)[0]["val_accuracy"] > 0.9


def test_regression_by_editing_only_the_task_files(tmp_path):
    """--dataset regression: real-valued targets, and model.py's loss (MSE) and metrics (R^2);
    nothing outside dataset.py and model.py knows about it."""
    run_training(tmp_path, *SYNTHETIC, "--dataset", "regression", "--epochs", "2", nproc=2, tiny=False)
    first, last = read_metrics(tmp_path)
    assert "val_accuracy" not in last
    assert last["val_loss"] < first["val_loss"] and last["val_r2"] > 0.5, (first, last)
