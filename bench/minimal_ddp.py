"""The floor: the least DDP code that trains the generated project's model on its data.

Init, DDP wrap, DistributedSampler, loop; nothing else (no evaluation, checkpoints, logging,
AMP, clipping or schedule). Run under torchrun from the generated project's folder:

    torchrun --standalone --nproc_per_node=2 minimal_ddp.py --train_samples 16384 ...
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path.cwd()))  # the generated project: the same dataset and model code
from dataset import SyntheticClassification
from model import MLP

parser = argparse.ArgumentParser()
for name, default in [("train_samples", 16384), ("input_dim", 256), ("hidden_dim", 1024), ("num_classes", 10),
                      ("batch_size", 64), ("epochs", 2), ("seed", 0)]:  # fmt: skip
    parser.add_argument(f"--{name}", type=int, default=default)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.01)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(args.seed)
data = SyntheticClassification(args.train_samples, args.input_dim, args.num_classes, args.seed, "train")
sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
model = DDP(MLP(args.input_dim, args.hidden_dim, args.num_classes))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

if rank == 0:
    print("BENCH first step", flush=True)
# Timed from the end of the first step, as train.py's samples_per_s (steady state).
samples, started, cpu_started = 0, None, None
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        if started is None:
            started, cpu_started = time.perf_counter(), time.process_time()
            continue
        samples += len(targets)
loop_seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
if rank == 0:
    world = dist.get_world_size()
    print("BENCH " + json.dumps({"loop_s": loop_seconds, "cpu_s": cpu_seconds, "samples": samples * world}), flush=True)
# DDP's reducer sits in reference cycles that keep the group alive past destroy_process_group;
# freed at interpreter exit, gloo's threads then abort the process now and then ("terminate
# called without an active exception": half the runs with bucket views). Collected first, as the
# generated project's cleanup_distributed does.
gc.collect()
dist.destroy_process_group()
