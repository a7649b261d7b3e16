"""Yours: the model, a small ResNet for image classification. Replace `build_model` to train your
own; task.py hands it to the machinery (every hook: ddp_utils/contract.py's docstring)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob


@dataclass(frozen=True)
class ModelConfig:
    """The model's knobs: fields of Config, each a --flag."""

    num_classes: int = knob(0, "classes, 0 = the number of class folders in data_dir (or data_dir/train)")
    width: int = knob(32, "channels of the first of 3 stages, doubled at each of the next two")
    depth: int = knob(2, "basic blocks per stage")
    sync_batchnorm: bool = knob(True, "batch statistics over the global batch, not each process's share")
    channels_last: bool = knob(False, "NHWC memory layout: faster convolutions on tensor-core GPUs")

    def check_model(self):
        if self.num_classes < 0 or self.num_classes == 1:
            raise ConfigError("num_classes", "must be 0 (count the class folders) or at least 2")
        for name in ("width", "depth"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")

    def resolve_model(self):
        if self.num_classes:
            return {}
        from dataset import class_names  # the dataset's own definition of a class: the labels must agree

        try:
            return {"num_classes": len(class_names(self.data_dir))}
        except ConfigError as error:  # the data's problem; a run without data (preflight.py) can set the count
            problem = f"is 0 (one per class folder) but --data_dir {error.problem} (or set --num_classes)"
            raise ConfigError("num_classes", problem) from None


SHAPE_FIELDS = ("num_classes", "width", "depth")  # a checkpoint to resume must match


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the input (through a 1x1 conv where the shape changes), ReLU."""

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        # Zero-init the last BN: every block starts as the identity, so the deep net trains like a
        # shallow one at first (Goyal et al., "Accurate, Large Minibatch SGD").
        nn.init.zeros_(self.bn2.weight)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, 3 stages of `depth` blocks (width, 2x width, 4x width channels; stages 2 and 3 halve
    the resolution), global average pool, linear head. Sized for small images (32x32)."""

    def __init__(self, num_classes, width, depth, channels_last=False):
        super().__init__()
        self.channels_last = channels_last
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.ModuleList()  # --strategy fsdp shards stage by stage (shard_units)
        channels = width
        for stage in range(3):
            out_channels = width * 2**stage
            blocks = [BasicBlock(channels, out_channels, stride=1 if stage == 0 else 2)]
            blocks += [BasicBlock(out_channels, out_channels, stride=1) for _ in range(depth - 1)]
            self.stages.append(nn.Sequential(*blocks))
            channels = out_channels
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images):
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean(dim=(2, 3)))

    def shard_units(self):
        """What --strategy fsdp shards one by one: each stage (the stem and head go with the model)."""
        return self.stages


# --- synchronized batch norm ---------------------------------------------------------------
#
# The DDP pitfall: BatchNorm normalises with the statistics of the batch it sees, and under DDP
# that is each process's share, not the global batch. With small per-process batches the
# statistics are noisy, and the model trained on N processes is not the one trained on one.
# torch.nn.SyncBatchNorm fixes that with fused kernels, on GPUs only: it (and DDP, which checks
# for it) refuses CPU tensors. So where the model trains on the CPU (gloo), here is the same
# arithmetic in plain tensor ops (build_model picks one of the two).


class SyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch (all processes).

    Evaluation, a single process and the meta device (FLOP counting) use plain BatchNorm2d:
    there is nothing to synchronise. The parameters and buffers are BatchNorm2d's, so a
    checkpoint loads with sync_batchnorm on or off, and on GPUs or not.
    """

    # Running statistics of the global batch: the same on every rank, so DDP need not
    # broadcast rank 0's before each forward (strategy.buffers_may_differ).
    same_buffers_on_every_rank = True

    def forward(self, x):
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not self.training or not distributed or x.is_meta:
            return super().forward(x)
        self.num_batches_tracked += 1
        # momentum None: a cumulative average, its weight a tensor (no host sync to read the count).
        momentum = (
            self.momentum if self.momentum is not None else (1 / self.num_batches_tracked).to(self.running_mean.dtype)
        )
        return _SyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean, self.running_var, momentum, self.eps)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        channels = x.shape[1]
        xf = at_least_float32(x)  # statistics in fp32 at least, also under autocast
        # One all-reduce of [sum | sum of squares | count] per channel: the global mean and variance.
        # (Sums, not each rank's mean: ranks may hold different numbers of samples, even none.)
        stats = torch.cat([xf.sum((0, 2, 3)), xf.square().sum((0, 2, 3)), xf.new_full((1,), xf.numel() / channels)])
        dist.all_reduce(stats)
        total, total_sq, count = stats.split([channels, channels, 1])
        mean = total / count
        var = (total_sq / count - mean.square()).clamp(min=0)  # biased, as BatchNorm normalises with
        invstd = torch.rsqrt(var + eps)
        running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        unbiased = var * count / (count - 1).clamp(min=1)  # what BatchNorm2d keeps in running_var
        running_var.lerp_(unbiased.to(running_var.dtype), momentum)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        x_hat = (xf - mean[:, None, None]) * invstd[:, None, None]
        return (x_hat * weight[:, None, None] + bias[:, None, None]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd, count = ctx.saved_tensors
        channels = x.shape[1]
        x_hat = (at_least_float32(x) - mean[:, None, None]) * invstd[:, None, None]
        grad_out = at_least_float32(grad_out)
        local = torch.cat([grad_out.sum((0, 2, 3)), (grad_out * x_hat).sum((0, 2, 3))])
        grad_bias, grad_weight = local.split(channels)  # this rank's share: DDP averages them like any gradient
        # The input gradient depends on every sample of the global batch through the mean and
        # variance: it needs the two per-channel sums over all ranks.
        total = local.clone()
        dist.all_reduce(total)
        sum_dy, sum_dy_xhat = (total / count).split(channels)
        scale = (weight * invstd)[:, None, None]
        grad_x = (grad_out - sum_dy[:, None, None] - x_hat * sum_dy_xhat[:, None, None]) * scale
        # Each rank returns its samples' gradient of the global-batch statistics; DDP's average of
        # the parameter gradients then equals one process's gradient of the whole batch.
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None, None, None, None


def at_least_float32(tensor):
    """fp16 and bf16 as float32; float64 (the tests' exact runs) kept."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def sync_batchnorms(module):
    """Replace every nn.BatchNorm2d in `module` by a SyncBatchNorm2d with the same state (before DDP
    wraps it). Only affine ones with running statistics, the default (this ResNet has no other)."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d and child.affine and child.track_running_stats:
            sync = SyncBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine)
            sync.load_state_dict(child.state_dict())
            setattr(module, name, sync.train(child.training))
        else:
            sync_batchnorms(child)
    return module


def build_model(cfg):
    model = ResNet(cfg.num_classes, cfg.width, cfg.depth, cfg.channels_last)
    if cfg.sync_batchnorm:
        # Where the model trains on GPUs (--device, ddp_utils.distributed.device.choose_device), torch's fused
        # SyncBatchNorm; on the CPU the hand-written one. (Configs saved before --device: auto.)
        on_gpus = getattr(cfg, "device", "auto") != "cpu" and torch.cuda.is_available()
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if on_gpus else sync_batchnorms(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
