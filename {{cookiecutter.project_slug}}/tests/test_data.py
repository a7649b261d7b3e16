"""The data split across ranks: world-size independent batches and exact evaluation."""

from types import SimpleNamespace

import torch

from config import Config
from dataset import ShardedSampler, build_datasets, build_loaders


def global_batches(num_samples, global_batch, world_size, epoch=0, seed=0):
    """The set of samples in each global batch when `world_size` ranks draw from the sampler."""
    per_rank = global_batch // world_size
    shards = []
    for rank in range(world_size):
        sampler = ShardedSampler(num_samples, global_batch, rank, world_size, seed)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        shards.append([indices[i : i + per_rank] for i in range(0, len(indices), per_rank)])
    return [set().union(*(shard[k] for shard in shards)) for k in range(len(shards[0]))]


def test_global_batches_do_not_depend_on_world_size():
    one, two, four = (global_batches(1000, 64, world_size) for world_size in (1, 2, 4))
    assert one == two == four
    assert len(one) == 1000 // 64
    assert all(len(batch) == 64 for batch in one)
    seen = set().union(*one)
    assert len(seen) == 15 * 64  # no duplicates; only the incomplete last global batch is dropped


def test_epochs_and_seeds_change_the_order():
    assert global_batches(256, 32, 2, epoch=0) != global_batches(256, 32, 2, epoch=1)
    assert global_batches(256, 32, 2, seed=0) != global_batches(256, 32, 2, seed=1)


def test_start_skips_exactly_the_consumed_batches():
    full = ShardedSampler(256, 32, 1, 2, seed=3)
    resumed = ShardedSampler(256, 32, 1, 2, seed=3)
    full.set_epoch(5)
    resumed.set_epoch(5, start=3 * 32)
    assert list(resumed) == list(full)[3 * 16 :]


def test_validation_covers_every_sample_once_for_any_world_size():
    cfg = Config(val_samples=1001, train_samples=128, batch_size=16)
    _, val = build_datasets(cfg)
    for world_size in (1, 2, 3):
        seen = []
        for rank in range(world_size):
            ctx = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
            _, val_loader = build_loaders(cfg, ctx)
            seen += [x for batch, _ in val_loader for x in batch]
        assert len(seen) == 1001
        assert sorted(x.tolist() for x in seen) == sorted(x.tolist() for x in val.inputs)


def test_dataset_is_deterministic_from_seed():
    a, _ = build_datasets(Config(seed=1))
    b, _ = build_datasets(Config(seed=1))
    c, _ = build_datasets(Config(seed=2))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_only_the_training_loader_keeps_its_workers():
    """Persistent workers for training (every epoch); the validation loader's workers end after
    each evaluation instead of holding memory for the whole run."""
    cfg = Config(num_workers=2, persistent_workers=True, train_samples=128, val_samples=64)
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    train_loader, val_loader = build_loaders(cfg, ctx)
    assert train_loader.persistent_workers and not val_loader.persistent_workers
