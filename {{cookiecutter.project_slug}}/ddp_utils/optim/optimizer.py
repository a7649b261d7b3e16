"""The optimizer and gradient clipping: AdamW in two groups, or Muon for the hidden weight
matrices beside AdamW for the rest (`build_optimizer`), and the global gradient norm
(`clip_grad_norm`), the two per-step passes over every parameter."""

import math

import torch
from torch import nn

from .muon import MuonWithAdamW, muon_parameters


def build_optimizer(model, cfg, device, module=None):
    """The optimizer --optimizer names, over the model's parameters as the strategy left them
    (FSDP's are the local shards). `module` is the model as build_model made it, for its
    muon_parameters() hook (default: the model).

    adamw: AdamW in two groups: weight decay on matrices, convolution kernels and embeddings (2
    or more dimensions) only; biases and normalisation weights never decay, as in nanoGPT and
    torchtitan (decaying a LayerNorm gain towards 0 fights what it is there for). The fused
    implementation, one kernel for all parameters (FSDP2's DTensors included), on GPUs and on
    the CPU too, where torch would otherwise loop over them in Python (the template's
    benchmarks: 3.6% of a small GPT's throughput).

    muon: MuonWithAdamW: Muon for the hidden weight layers (muon_parameters) at --muon_lr, AdamW
    in the same two groups for everything else at --lr."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(adamw_groups(parameters, cfg), lr=cfg.lr, fused=fused)
    module = module if module is not None else getattr(model, "module", model)  # inside DDP
    hidden = {id(p) for p in muon_parameters(module, model)}
    groups = [
        {
            "params": [p for p in parameters if id(p) in hidden],
            "weight_decay": cfg.weight_decay,
            "muon": True,
            "lr": cfg.muon_lr,
        },  # fmt: skip
        *adamw_groups([p for p in parameters if id(p) not in hidden], cfg),
    ]
    # Under ddp the ranks share Newton-Schulz's work (MuonExchange); fsdp's sharded parameters
    # carry their own mesh.
    process_group = model.process_group if isinstance(model, nn.parallel.DistributedDataParallel) else None
    return MuonWithAdamW(groups, lr=cfg.lr, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, fused=fused,
                         process_group=process_group)  # fmt: skip


def peak_lr(group, cfg):
    """The learning rate a parameter group's schedule peaks at: --muon_lr for Muon's matrices
    (its best is its own: docs/optimizers.md), --lr for the rest."""
    return cfg.muon_lr if group.get("muon") else cfg.lr


def adamw_groups(parameters, cfg):
    """AdamW's two groups: decay on 2 or more dimensions, none on biases and norm weights."""
    return [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]


@torch.no_grad()
def clip_grad_norm(parameters, max_norm):
    """The global 2-norm of the parameters' gradients, which are scaled down to `max_norm` where
    it is larger; `max_norm` inf measures it only. The same arithmetic as
    torch.nn.utils.clip_grad_norm_ (the same result to the bit), without its grouping of the
    gradients by device and dtype on every call when they share one (most of its host time on
    a small model), and without multiplying every gradient by 1 when nothing can be clipped.
    Anything else (FSDP's DTensors, several devices or dtypes) goes to torch's."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    kinds = {(type(g), g.device, g.dtype) for g in grads}
    if len(kinds) != 1 or next(iter(kinds))[0] is not torch.Tensor or grads[0].device.type not in ("cpu", "cuda"):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # FSDP's DTensors, several devices or dtypes
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm != math.inf:
        # No `if norm > max_norm`: reading the norm would make the host wait for the device.
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
