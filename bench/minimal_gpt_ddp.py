"""The floor for the language task: the least DDP code that trains the generated project's GPT on
its token windows.

Init, DDP wrap, DistributedSampler, loop; nothing else (no evaluation, checkpoints, logging,
AMP, clipping or schedule). Run under torchrun from a generated language project's folder:

    torchrun --standalone --nproc_per_node=2 minimal_gpt_ddp.py --data_dir data/text ...
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path.cwd()))  # the generated project: the same dataset and model code
from dataset import TokenWindows
from model import GPT

parser = argparse.ArgumentParser()
for name, default in [("train_samples", 4096), ("block_size", 128), ("n_layer", 4), ("n_head", 4), ("n_embd", 128),
                      ("batch_size", 16), ("epochs", 1), ("seed", 0)]:  # fmt: skip
    parser.add_argument(f"--{name}", type=int, default=default)
parser.add_argument("--data_dir", default="data/text")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.01)
# Off in the floor. bench/run.py --ceiling turns them on: the generated loop's two structural
# choices with none of its work, the most any loop can gain on this job without touching the model.
parser.add_argument("--fused_adamw", action="store_true")
parser.add_argument("--bucket_views", action="store_true", help="DDP's gradient_as_bucket_view")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(args.seed)
data = TokenWindows(Path(args.data_dir) / "train.bin", args.block_size, args.train_samples, seed=args.seed)
sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
config = SimpleNamespace(vocab_size=256, dropout=0.0, gelu="exact", activation_checkpointing=False, **vars(args))
model = DDP(GPT(config), gradient_as_bucket_view=args.bucket_views)
optimizer = torch.optim.AdamW(
    model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=args.fused_adamw or None
)

if rank == 0:
    print("BENCH first step", flush=True)
# Timed from the end of the first step, as train.py's samples_per_s (steady state).
samples, started, cpu_started = 0, None, None
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    data.set_epoch(epoch)
    for inputs, targets in loader:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
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
