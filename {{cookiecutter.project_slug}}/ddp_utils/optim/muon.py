"""Muon for the hidden weight matrices, beside AdamW for the rest (--optimizer muon).

Newton-Schulz orthogonalises each matrix's momentum, batched by shape; each rank orthogonalises
its share of the matrices and the results reach every rank that needs them (`MuonExchange`:
one all-gather under ddp, two all-to-alls of rows under fsdp and hsdp).
"""

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.compat import all_gather_single
from ..core.tensors import local


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


def newton_schulz(matrices, steps, eps=1e-7):
    """The nearest (semi-)orthogonal matrices to a batch of same-shaped `matrices` (batch, rows,
    columns), approximately: Keller Jordan's quintic Newton-Schulz iteration with torch.optim.Muon's
    coefficients, one batched matmul per stage for the whole batch. Each matrix gets torch's
    result to the bit (in the same dtype): a batched matmul computes each matrix as a matmul of
    its own, and a tall batch is iterated on as its transposed view, as torch does each matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = matrices.size(1) > matrices.size(2)
    x = matrices.mT if tall else matrices  # rows <= columns: the Gram matrices are the small side
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # spectral norms at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


# Where newton_schulz is compiled, and by which torch.compile backend: on GPUs; elsewhere eager.
COMPILED_ON = {"cuda": "inductor"}
SHAPES = set()  # the batch shapes newton_schulz was compiled for in this process: a graph each


@functools.cache
def compiled_newton_schulz(backend="inductor"):
    """newton_schulz compiled for GPUs: one graph per batch shape (static shapes, as nanochat
    and the speedrun compile it), its elementwise steps fused around the matmuls."""
    return torch.compile(newton_schulz, dynamic=False, fullgraph=True, backend=backend)


def compiled_call(batch, steps, backend):
    """compiled_newton_schulz(backend) of `batch`, with room for a graph per batch shape. A
    model has as many shapes as it likes (a ConvNet's widths, a model of many sizes), and one
    graph each is what static shapes are for: Dynamo's recompile limit (8 graphs of a function,
    whatever the device) would end the run at the ninth under fullgraph=True. The limits are
    raised only around these calls, never for the model's own compile (--compile)."""
    SHAPES.add((tuple(batch.shape), batch.dtype, batch.device, steps))
    config = torch._dynamo.config
    limits = {"recompile_limit": max(config.recompile_limit, len(SHAPES)),
              "accumulated_recompile_limit": max(config.accumulated_recompile_limit, len(SHAPES))}  # fmt: skip
    with config.patch(limits):
        return compiled_newton_schulz(backend)(batch, steps)


def newton_schulz_dtype(tensor):
    """On GPUs bf16, as torch's Muon and the speedrun (the iteration tolerates it, the tensor
    cores are fast at it); on the CPU, and in float64 anywhere (the tests, the doctor), the
    update's own dtype, so that float64 runs compare exactly."""
    return torch.bfloat16 if tensor.device.type == "cuda" and tensor.dtype != torch.float64 else tensor.dtype


def orthogonalise(matrices, steps):
    """newton_schulz of same-shaped 2-D matrices as one batch, returned as a batch: on GPUs
    compiled (COMPILED_ON), elsewhere eager."""
    batch = torch.stack(matrices)
    if backend := COMPILED_ON.get(batch.device.type):
        return compiled_call(batch, steps, backend)
    return newton_schulz(batch, steps)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (momentum orthogonalised by Newton-Schulz) for the groups marked "muon", AdamW for the
    others, as one optimizer: one set of param_groups for the schedule and the loss scaler, one
    state_dict for checkpoints (plain or sharded). Muon's step is torch.optim.Muon's (Nesterov
    momentum, decoupled weight decay, its update scaled by 0.2 x sqrt(max(rows, columns)):
    "match_rms_adamw"), arranged for speed: the momentum and the parameters' updates are
    foreach calls over all matrices, Newton-Schulz one batched call per shape, and with several
    processes each matrix is orthogonalised by one of them, which shares the result
    (MuonExchange): not every rank all of them. Never a shard on its own under fsdp: that
    would be another, wrong, update, with no error."""

    def __init__(self, groups, lr, momentum, ns_steps, fused, process_group=None):
        super().__init__(groups, {"lr": lr, "muon": False, "momentum": momentum, "ns_steps": ns_steps})
        self.process_group = process_group  # ddp's: the ranks share the Newton-Schulz work
        self.exchange = None  # made at the first step
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
        groups = [group for group in self.param_groups if group["muon"]]
        if self.exchange is None:
            self.exchange = MuonExchange([(group["params"], group["ns_steps"]) for group in groups], self.process_group)
        updates = {}  # parameter: its update as this rank holds it, before Newton-Schulz
        for group in groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            for p in stepped:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            if stepped:
                grads = [local(p.grad) for p in stepped]
                buffers = [local(self.state[p]["momentum_buffer"]) for p in stepped]
                torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
                updates.update(zip(stepped, torch._foreach_lerp(grads, buffers, group["momentum"])))  # Nesterov
        orthogonal = self.exchange.orthogonalise(updates)
        for group in groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            if stepped:
                lr, parameters = group["lr"], [local(p) for p in stepped]
                torch._foreach_mul_(parameters, 1 - lr * group["weight_decay"])
                for p, parameter in zip(stepped, parameters):
                    rows, columns = p.shape[0], math.prod(p.shape[1:])  # a kernel: output channels x the rest
                    parameter.add_(orthogonal[p], alpha=-(lr * (0.2 * math.sqrt(max(rows, columns)))))  # torch's order


class MuonExchange:
    """Who orthogonalises which of Muon's matrices, and how the results reach the ranks that
    need them. The matrices (a convolution kernel as output channels x the rest) are batched by
    shape, and dealt to the W ranks in turn, batch after batch (rank r takes matrices r, r + W,
    ...: about 1/W of the work each, and of each shape). The plan is fixed, the same on every
    rank, and so are the sizes each rank sends: a matrix without a gradient in a step is sent
    as zeros (and not applied).

    - One process, or plain tensors and no `process_group`: every matrix here, no exchange.
    - ddp (`process_group`): every rank holds every whole update (the gradients are all-reduced);
      each orthogonalises its matrices, and one all-gather hands every rank all the results.
    - fsdp/hsdp (DTensors sharded by rows over one mesh dimension): each rank holds some rows of
      every update. One all_to_all_single sends each matrix's rows to the rank that takes it,
      which orthogonalises it whole; a second sends each rank its rows of every result. Under
      hsdp each replica does the same work.
    Updates travel in newton_schulz_dtype (bf16 on GPUs: what Newton-Schulz starts from anyway).
    """

    def __init__(self, groups, process_group=None):
        self.batches = {}  # (rows, columns, Newton-Schulz steps): [parameters]
        for parameters, steps in groups:
            for p in parameters:
                self.batches.setdefault((p.shape[0], math.prod(p.shape[1:]), steps), []).append(p)
        first = local(next(p for ps, _ in groups for p in ps))
        self.device, self.dtype = first.device, newton_schulz_dtype(first)
        self.group, self.size, self.rank, self.sharded = process_group, 1, 0, False
        meshes = {(p.device_mesh, p.placements) for ps, _ in groups for p in ps if isinstance(p, DTensor)}
        if meshes:
            ((mesh, placements),) = meshes  # FSDP2: one mesh, every parameter sharded by rows
            (dim,) = [i for i, placement in enumerate(placements) if placement.is_shard(dim=0)]
            self.group, self.sharded = mesh.get_group(dim), True
            self.size, self.rank = mesh.size(dim), mesh.get_local_rank(dim)
        elif process_group is not None:
            self.size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        # What each rank takes, batch by batch: {(rows, columns, steps): [parameters]}.
        ordered = [(key, p) for key, batch in self.batches.items() for p in batch]
        self.taken = [{} for _ in range(self.size)]
        for i, (key, p) in enumerate(ordered):
            self.taken[i % self.size].setdefault(key, []).append(p)

    def orthogonalise(self, updates):
        """{parameter: its update orthogonalised (this rank's rows of it under fsdp)} for the
        parameters in `updates` ({parameter: its update as this rank holds it})."""
        if self.size == 1:
            return {p: m.view(p.shape) for p, m in self.orthogonalise_mine(updates).items() if p in updates}
        return self._sharded(updates) if self.sharded else self._replicated(updates)

    def orthogonalise_mine(self, wholes):
        """{parameter: its whole update orthogonalised, as a matrix} for the parameters this rank
        takes, one batched call per shape; `wholes` holds their whole updates (any shape)."""
        done = {}
        for (rows, _, steps), batch in self.taken[self.rank].items():
            matrices = [self.update(wholes, p).reshape(rows, -1) for p in batch]
            done.update(zip(batch, orthogonalise(matrices, steps)))
        return done

    def update(self, updates, p):
        """`p`'s update in `updates` in the exchange's dtype, or zeros of the shape this rank holds."""
        update = updates.get(p)
        return local(p).new_zeros(local(p).shape, dtype=self.dtype) if update is None else update.to(self.dtype)

    def _replicated(self, updates):
        """ddp: each rank its matrices, then one all-gather of everyone's results (each rank's
        padded to the largest share)."""
        ranks = range(self.size)
        numels = [sum(p.numel() for batch in self.taken[rank].values() for p in batch) for rank in ranks]
        mine = list(self.orthogonalise_mine(updates).values())
        sent = torch.zeros(max(numels), dtype=self.dtype, device=self.device)
        if mine:
            torch.cat([m.flatten() for m in mine], out=sent[: numels[self.rank]])
        gathered = sent.new_empty(self.size * sent.numel())
        all_gather_single(gathered, sent, group=self.group)
        done = {}
        for rank, results in zip(ranks, gathered.view(self.size, -1)):
            theirs = [p for batch in self.taken[rank].values() for p in batch]
            for p, values in zip(theirs, results[: numels[rank]].split([p.numel() for p in theirs])):
                if p in updates:
                    done[p] = values.view(p.shape)
        return done

    def _sharded(self, updates):
        """fsdp: each matrix's rows to the rank that takes it, orthogonalised whole there, and
        each rank's rows of the result back to it."""
        ranks = range(self.size)
        theirs = [[p for batch in self.taken[rank].values() for p in batch] for rank in ranks]
        # 1. This rank's rows of every matrix to the rank that takes it; every rank's rows of this
        # rank's matrices here, in the ranks' order: each matrix whole.
        sent = [self.update(updates, p).flatten() for rank in ranks for p in theirs[rank]]
        to_takers = [sum(self.numel(p, self.rank) for p in theirs[rank]) for rank in ranks]
        from_holders = [sum(self.numel(p, rank) for p in theirs[self.rank]) for rank in ranks]
        got = self.all_to_all(sent, to_takers, from_holders)
        rows = [part.split([self.numel(p, rank) for p in theirs[self.rank]]) for rank, part in
                zip(ranks, got.split(from_holders))]  # fmt: skip
        wholes = {p: torch.cat([rows[rank][i] for rank in ranks]) for i, p in enumerate(theirs[self.rank])}
        # 2. This rank's matrices orthogonalised; each rank sent its rows of them.
        results = self.orthogonalise_mine(wholes)
        sent = [results[p][self.rows(p, rank)].flatten() for rank in ranks for p in theirs[self.rank]]
        got = self.all_to_all(sent, from_holders, to_takers)
        order = [p for rank in ranks for p in theirs[rank]]
        held = got.split([self.numel(p, self.rank) for p in order])
        return {p: values.view(local(p).shape) for p, values in zip(order, held) if p in updates}

    def rows(self, p, rank):
        """The rows of `p` that `rank` holds under fsdp: torch.chunk's split, as FSDP2's."""
        chunk = math.ceil(p.shape[0] / self.size)
        return slice(min(p.shape[0], rank * chunk), min(p.shape[0], (rank + 1) * chunk))

    def numel(self, p, rank):
        """Elements of `p` that `rank` holds under fsdp."""
        rows = self.rows(p, rank)
        return (rows.stop - rows.start) * math.prod(p.shape[1:])

    def all_to_all(self, pieces, sent_sizes, received_sizes):
        """all_to_all_single of the concatenated `pieces` (sent_sizes[r] elements to rank r)."""
        sent = torch.cat(pieces) if pieces else torch.zeros(0, dtype=self.dtype, device=self.device)
        received = sent.new_empty(sum(received_sizes))
        dist.all_to_all_single(received, sent, received_sizes, sent_sizes, group=self.group)
        return received
