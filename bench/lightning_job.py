"""The benchmark's job in PyTorch Lightning, for comparison: Trainer with its defaults (logger,
progress bar, a checkpoint every epoch) or Fabric (a hand-written loop on Lightning's launcher).
Only used by bench/run.py when `lightning` is installed. Run under torchrun from the generated
project's folder:

    torchrun --standalone --nproc_per_node=2 lightning_job.py trainer|fabric --train_samples 16384 ...
"""

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path.cwd()))  # the generated project: the same dataset and model code
from dataset import SyntheticClassification
from model import MLP

parser = argparse.ArgumentParser()
parser.add_argument("flavour", choices=["trainer", "fabric"])
parser.add_argument("--train_samples", type=int, default=16384)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()
INPUT, HIDDEN, CLASSES, BATCH, LR, WEIGHT_DECAY, SEED = 256, 1024, 10, 64, 1e-3, 0.01, 0


def data():
    return SyntheticClassification(args.train_samples, INPUT, CLASSES, SEED, "train")


def report(fabric_or_trainer_rank, started, cpu_started, samples):
    if fabric_or_trainer_rank == 0:
        loop_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        print("BENCH " + json.dumps({"loop_s": loop_s, "cpu_s": cpu_s, "samples": samples}), flush=True)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = MLP(INPUT, HIDDEN, CLASSES)

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        loss = F.cross_entropy(self.model(inputs), targets)
        self.log("train_loss", loss)  # what a Lightning user writes; logged every 50 steps by default
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def on_train_start(self):
        if self.global_rank == 0:
            print("BENCH first step", flush=True)
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_train_end(self):
        samples = self.trainer.global_step * BATCH * self.trainer.world_size
        report(self.global_rank, self.started, self.cpu_started, samples)


def run_trainer():
    L.seed_everything(SEED)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(Classifier(), loader)


def run_fabric():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(SEED)
    model = MLP(INPUT, HIDDEN, CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model, optimizer = fabric.setup(model, optimizer)
    dataset = data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED, drop_last=True)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True),
                                      use_distributed_sampler=False)  # fmt: skip
    if fabric.global_rank == 0:
        print("BENCH first step", flush=True)
    samples, started, cpu_started = 0, time.perf_counter(), time.process_time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()
            samples += len(targets) * fabric.world_size
    report(fabric.global_rank, started, cpu_started, samples)


if __name__ == "__main__":
    run_trainer() if args.flavour == "trainer" else run_fabric()
