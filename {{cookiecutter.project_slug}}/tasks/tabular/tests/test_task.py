"""The tabular task: its data, its model's FLOP count, and the worked example of a second dataset."""

from types import SimpleNamespace

import torch
from conftest import read_metrics, run_training

import dataset
from config import Config
from dataset import SyntheticClassification, build_datasets
from ddp_utils import metrics
from ddp_utils.contract import load_task
from ddp_utils.data import build_loaders, start_epoch


def test_dataset_is_deterministic_from_seed():
    a, _ = build_datasets(Config(seed=1))
    b, _ = build_datasets(Config(seed=1))
    c, _ = build_datasets(Config(seed=2))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_persistent_workers_still_get_fresh_noise_every_epoch():
    cfg = Config(train_samples=64, batch_size=8, num_workers=2, persistent_workers=True, input_noise_std=1.0)
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
    (dataset.gaussian_noise), not a generator and a hash per sample, and each sample's noise
    still depends on (seed, epoch, index) only: alone or in any batch, in any order, the same."""
    data = SyntheticClassification(512, 8, 4, seed=3, split="train", noise_std=1.0)
    data.set_epoch(2)
    draws, draw = [], dataset.gaussian_noise
    monkeypatch.setattr(dataset, "gaussian_noise", lambda *args: draws.append(args) or draw(*args))
    batch = data.__getitems__(list(range(256)))
    assert len(draws) == 1
    again = data.__getitems__([200, 3, 17])
    assert torch.equal(again[1][0], batch[3][0]) and torch.equal(data[17][0], batch[17][0])
    noise = torch.stack([inputs for inputs, _ in batch]) - data.inputs[:256]
    assert abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05  # standard normal
    data.set_epoch(3)
    assert not torch.allclose(data[17][0], batch[17][0])  # fresh noise every epoch


def test_flops_per_sample_are_counted_as_the_model_runs():
    """FlopCounterMode on a meta-device model: 2 FLOPs per weight forward, 2 for the weight
    gradient, 2 for the input gradient, except the first layer's (inputs need no gradient)."""
    cfg = Config(input_dim=8, hidden_dim=16, num_classes=4)
    weights = 8 * 16 + 16 * 16 + 16 * 4
    batch = (torch.zeros(1, 8), torch.tensor([1]))
    assert metrics.flops_per_sample(cfg, load_task(), batch) == 6 * weights - 2 * 8 * 16


def test_second_dataset_through_config(tmp_path):
    """The README's worked example: another dataset class, chosen with --dataset."""
    run_training(tmp_path, "--dataset", "blobs", "--epochs", "1")
    assert read_metrics(tmp_path)[0]["val_accuracy"] > 0.9


def test_regression_by_editing_only_the_task_files(tmp_path):
    """--dataset regression: real-valued targets, and model.py's loss (MSE) and metrics (R^2);
    nothing outside dataset.py and model.py knows about it."""
    run_training(tmp_path, "--dataset", "regression", "--epochs", "2", nproc=2)
    first, last = read_metrics(tmp_path)
    assert "val_accuracy" not in last
    assert last["val_loss"] < first["val_loss"] and last["val_r2"] > 0.5, (first, last)
