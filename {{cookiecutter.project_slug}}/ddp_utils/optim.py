"""The optimizer and gradient clipping: AdamW in two groups, or Muon for the hidden weight
matrices beside AdamW for the rest (`build_optimizer`), and the global gradient norm
(`clip_grad_norm`), the two per-step passes over every parameter."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


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

    muon: MuonWithAdamW: Muon for the hidden weight layers (muon_parameters), AdamW in the
    same two groups for everything else."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(adamw_groups(parameters, cfg), lr=cfg.lr, fused=fused)
    module = module if module is not None else getattr(model, "module", model)  # inside DDP
    hidden = {id(p) for p in muon_parameters(module, model)}
    groups = [
        {"params": [p for p in parameters if id(p) in hidden], "weight_decay": cfg.weight_decay, "muon": True},
        *adamw_groups([p for p in parameters if id(p) not in hidden], cfg),
    ]
    return MuonWithAdamW(groups, lr=cfg.lr, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, fused=fused)


def adamw_groups(parameters, cfg):
    """AdamW's two groups: decay on 2 or more dimensions, none on biases and norm weights."""
    return [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]


def muon_parameters(module, model):
    """The parameters of `model` (as the strategy wrapped it) that Muon takes: the model's own
    muon_parameters() hook (on `module`, as build_model made it), else its hidden weight layers
    (hidden_layers). The hook's parameters are matched by name, so FSDP's sharded ones are found
    too."""
    hook = getattr(module, "muon_parameters", None)
    chosen = list(hook()) if callable(hook) else [layer.weight for layer in hidden_layers(module)]
    names = {id(p): name for name, p in module.named_parameters()}
    wanted = {names[id(p)] for p in chosen if p.requires_grad}
    by_name = {strip_wrappers(name): p for name, p in model.named_parameters()}
    return [by_name[name] for name in sorted(wanted)]


def hidden_layers(module):
    """The Linear and convolution layers between the model's input and output layers, in module
    order: all of them but the last (the output head) and, in a model without an nn.Embedding
    (the input layer of a language model), the first (a ResNet's stem, an MLP's first layer: it
    reads the raw input); never one whose weight an embedding shares (a tied head). Muon's own
    rule (Keller Jordan): hidden 2-D weights, and hidden convolution kernels viewed as 2-D
    (output channels x the rest)."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    layers = [m for m in module.modules() if isinstance(m, kinds)]
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    shared = {id(m.weight) for m in embeddings}
    hidden = layers[:-1] if embeddings else layers[1:-1]
    return [m for m in hidden if id(m.weight) not in shared]


def strip_wrappers(name):
    """A parameter's name without what DDP, torch.compile and activation checkpointing add."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def newton_schulz(update, steps, eps=1e-7):
    """The nearest (semi-)orthogonal matrix to `update`, approximately: Keller Jordan's quintic
    Newton-Schulz iteration with torch.optim.Muon's coefficients. On GPUs in bf16, as torch's
    Muon and the speedrun do (the iteration tolerates it, the tensor cores are fast at it); on
    the CPU, and in float64 anywhere (the tests, the doctor), in the update's own dtype, so that
    float64 runs compare exactly."""
    a, b, c = 3.4445, -4.7750, 2.0315
    dtype = torch.bfloat16 if update.device.type == "cuda" and update.dtype != torch.float64 else update.dtype
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def orthogonalised(update, steps):
    """newton_schulz of a matrix, or of a convolution kernel viewed as output channels x the rest."""
    return newton_schulz(update.reshape(len(update), -1), steps).view_as(update)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (momentum orthogonalised by Newton-Schulz) for the groups marked "muon", AdamW for the
    others, as one optimizer: one set of param_groups for the schedule and the loss scaler, one
    state_dict for checkpoints (plain or sharded). Muon's step is torch.optim.Muon's (Nesterov
    momentum, decoupled weight decay, its update scaled by 0.2 x sqrt(max(rows, columns)) to
    AdamW's size: "match_rms_adamw", so --lr and --weight_decay apply to both; Muon's best
    --lr is still its own, docs/optimizers.md), with two changes:
    Newton-Schulz in the parameter's dtype off GPUs (newton_schulz), and whole matrices under
    fsdp: a sharded update is gathered, orthogonalised whole and cut back to this rank's rows
    (orthogonalising each shard on its own would be another, wrong, update, with no error)."""

    def __init__(self, groups, lr, momentum, ns_steps, fused):
        super().__init__(groups, {"lr": lr, "muon": False, "momentum": momentum, "ns_steps": ns_steps})
        self._link(fused)

    def _link(self, fused=None):
        """The AdamW that steps the other groups shares their dicts and the state."""
        adamw_groups = [g for g in self.param_groups if not g["muon"]]
        if not hasattr(self, "adamw"):
            self.adamw = torch.optim.AdamW(adamw_groups, lr=self.defaults["lr"], fused=fused)
        self.adamw.param_groups = adamw_groups
        self.adamw.state = self.state

    def summary(self):
        """What each optimizer holds, for the log at start."""
        counts = {True: [0, 0], False: [0, 0]}
        for group in self.param_groups:
            for p in group["params"]:
                counts[group["muon"]][0] += 1
                counts[group["muon"]][1] += p.numel()
        (muon, muon_numel), (adamw, adamw_numel) = counts[True], counts[False]
        return (f"--optimizer muon: Muon takes {muon} weight matrices ({muon_numel:,} parameters), AdamW the "
                f"other {adamw} tensors ({adamw_numel:,} parameters)")  # fmt: skip

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # new group dicts and a new state: linked again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_step(p, group)

    def _muon_step(self, p, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buffer, momentum = state["momentum_buffer"], group["momentum"]
        buffer.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buffer, momentum)  # Nesterov
        if isinstance(update, DTensor):  # fsdp: this rank's rows of the matrix
            whole = orthogonalised(update.full_tensor(), group["ns_steps"])
            # Every rank computed the same whole update: each keeps its own rows, no communication.
            update = distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
        else:
            update = orthogonalised(update, group["ns_steps"])
        rows, columns = p.shape[0], math.prod(p.shape[1:])  # a kernel as output channels x the rest
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(rows, columns)))


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
