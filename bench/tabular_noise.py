"""The tabular task's input noise: batches per second as the DataLoader asks for them.

    bash dev/bench.sh --tabular-noise

Bakes the tabular project and times `SyntheticClassification.__getitems__` (what the DataLoader
calls per batch) with `--input_noise_std 0.1`, batch 1024 of 32 features: the project's draw
(one vectorised counter-based draw per batch, `gaussian_noise` in ddp_utils/data/rows.py)
against the earlier draw, reproduced here (a torch.Generator seeded per sample from (seed,
epoch, index)). Then the
whole DataLoader, main process and 2 persistent workers, as train.py builds it (its second
epoch: workers already started). Both draws are functions
of (seed, epoch, index) alone. A benchmark, not a test: it asserts nothing.
"""

import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from cookiecutter.main import cookiecutter
from run import TEMPLATE, cpu_model

BATCH, SAMPLES, SECONDS = 1024, 65536, 3.0


def batches_per_second(get_batch, indices):
    """Batches of BATCH indices fetched per second, over at least SECONDS."""
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < SECONDS or count < 3:
        start = count * BATCH % (len(indices) - BATCH)
        get_batch(indices[start : start + BATCH])
        count += 1
    return count / elapsed


def main():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tabular-noise-bench-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work), extra_context={"task": "tabular"}))
    sys.path.insert(0, str(project))
    import dataset
    from config import Config
    from ddp_utils.data.loaders import build_loaders, mix_seed, start_epoch

    data = dataset.SyntheticClassification(SAMPLES, 32, 4, seed=0, split="train", noise_std=0.1)
    data.set_epoch(1)

    def per_sample(indices):  # the earlier draw: a generator and a hash per sample
        batch = []
        for index in indices:
            noise = torch.Generator().manual_seed(mix_seed(data.seed, int(data.epoch), index))
            batch.append((data.inputs[index] + 0.1 * torch.randn(32, generator=noise), data.targets[index]))
        return batch

    order = torch.randperm(SAMPLES).tolist()
    vectorised = batches_per_second(data.__getitems__, order)
    earlier = batches_per_second(per_sample, order)
    print(
        f"# bench/tabular_noise.py, {datetime.date.today()}, {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"# batch {BATCH} x 32 features, --input_noise_std 0.1, OMP_NUM_THREADS=1")
    print("| draw | where | batches/s | samples/s |")
    print("| --- | --- | --- | --- |")
    print(f"| per sample (earlier) | `__getitems__` | {earlier:.1f} | {earlier * BATCH:.0f} |")
    print(f"| per batch (now) | `__getitems__` | {vectorised:.1f} | {vectorised * BATCH:.0f} |")
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    for workers in (0, 2):
        # resolved(): the synthetic data's sizes filled in (input_dim and num_classes default to 0).
        cfg = Config(train_samples=SAMPLES, batch_size=BATCH, num_workers=workers, input_noise_std=0.1).resolved()
        loader, _ = build_loaders(cfg, ctx, *dataset.build_datasets(cfg))
        for epoch in (0, 1):  # the second epoch timed: persistent workers already started
            start_epoch(loader, epoch, rank=0, seed=cfg.seed)
            count, started = 0, time.perf_counter()
            for _ in loader:
                count += 1
        rate = count / (time.perf_counter() - started)
        print(f"| per batch (now) | DataLoader, {workers} workers (2nd epoch) | {rate:.1f} | {rate * BATCH:.0f} |")
    print(f"# per batch / per sample: {vectorised / earlier:.0f}x ({platform.python_version()})")


if __name__ == "__main__":
    main()
