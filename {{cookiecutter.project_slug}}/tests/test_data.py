"""The data split across ranks: world-size independent batches and exact evaluation."""

from types import SimpleNamespace

import torch
from conftest import TINY_CONFIG, read_metrics, run_training
from ddp_probe import BAD_SAMPLES

from config import Config
from ddp_utils.data.loaders import ShardedSampler, build_loaders


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
    cfg = Config(batch_size=16)
    val = [(torch.tensor([float(i)]), torch.tensor(0)) for i in range(1001)]
    for world_size in (1, 2, 3):
        seen = []
        for rank in range(world_size):
            ctx = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
            _, val_loader = build_loaders(cfg, ctx, val[:128], val)
            seen += [int(x) for batch, _ in val_loader for x in batch]
        assert sorted(seen) == list(range(1001))  # every sample once: no padding, no duplicates


def test_validation_workers_start_before_training_and_stay():
    """Persistent workers for training and evaluation; the validation loader's are started as the
    loaders are built, before any training step: a worker forked later from a process whose
    threads are busy training can deadlock in CPython < 3.12's fork. Evaluating draws nothing
    from the global random generator (its own seeds the workers)."""
    cfg = Config(num_workers=2, persistent_workers=True)
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    items = [(torch.zeros(1), torch.tensor(0))] * 128
    train_loader, val_loader = build_loaders(cfg, ctx, items, items)
    assert train_loader.persistent_workers and val_loader.persistent_workers
    workers = val_loader._iterator._workers  # started already
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
    state = torch.get_rng_state()
    assert sum(len(batch) for batch, _ in val_loader) == 128 and sum(len(batch) for batch, _ in val_loader) == 128
    assert val_loader._iterator._workers == workers  # the same processes, evaluation after evaluation
    assert torch.equal(torch.get_rng_state(), state)


def test_bad_samples_are_found_on_every_rank_and_reported_or_skipped_together(tmp_path):
    """A dataset's check_samples (here: tests/ddp_probe.py bad_samples) runs on each rank's share
    before the first step; every rank's finds in both sets are reported at once, in one `error:`
    line and with nothing written, or with --skip_bad_files left out of training and evaluation."""
    result = run_training(tmp_path / "stop", "--epochs", "1", nproc=2, probe="bad_samples", check=False)
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "3 bad samples in the training set (" in line and "1 bad sample in the validation set (" in line, line
    assert line.endswith(": --skip_bad_files true trains without them")
    assert all(f"sample {i} is bad" in line for samples in BAD_SAMPLES.values() for i in samples)
    assert "rank 0" in line and "rank 1" in line  # each rank checked its share
    assert not (tmp_path / "stop").exists()

    run_training(tmp_path / "skip", "--epochs", "1", "--skip_bad_files", "true", nproc=2, probe="bad_samples")
    log = (tmp_path / "skip" / "train.log").read_text()
    assert "--skip_bad_files: training without 3 bad samples in the training set" in log
    assert "--skip_bad_files: training without 1 bad sample in the validation set" in log
    assert read_metrics(tmp_path / "skip")[-1]["val_samples"] == TINY_CONFIG.val_samples - 1
