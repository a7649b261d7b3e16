"""How the model is spread over the processes: --strategy ddp or fsdp, chosen in `build_strategy`.

- ddp: every process holds the whole model, its gradients and the optimizer state (about 16
  bytes per parameter with AdamW under mixed precision); backward all-reduces the gradients.
- fsdp: FSDP2 (`fully_shard`) keeps 1/N of each on every process. A block's parameters are
  all-gathered just before it runs and freed after; backward reduce-scatters the gradients.
  With several replicas (--replicate_degree, by default one per node) it is hybrid sharding
  (HSDP): each replica shards over its own processes, so the all-gathers stay inside a node,
  and only the gradient shards are all-reduced between replicas. With --cpu_offload the
  shards (parameters, gradients, optimizer state) live in host memory and the optimizer steps
  there; each unit is copied to the GPU for its forward and backward.

The Trainer uses only what both offer (`model`, `module`, `name`, `sharded`, `sync_gradients`,
`clip_gradients`, `save`, `load`, `wait_for_checkpoint` and `close`), so the training loop is
one loop. The weights start the same under both, as the model's own code makes them
(`build_module`), or from pretrained weights (`load_full_weights`).
"""

import contextlib
import copy
import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checkpoint.sharded import read_sharded_state, regroup_optimizer_state, save_sharded_checkpoint
from ..checkpoint.single_file import save_checkpoint
from ..core.compat import BUFFER_SYNC, stager_reusable
from ..core.precision import AMP_DTYPES
from ..core.tensors import local
from ..errors import CheckpointError, ConfigError, TrainingError
from ..optim.optimizer import clip_grad_norm
from .blocks import shard_units
from .comm_hooks import register_comm_hook
from .model_init import build_module


def build_strategy(cfg, ctx, build_model):
    """The model `build_model(cfg)` makes, wrapped for --strategy: the one place the choice is made.
    A setting that does not fit (this world size, this model) is the same on every rank: a
    TrainingError, reported once."""
    try:
        if cfg.strategy == "fsdp":
            return FSDPStrategy(cfg, ctx, build_model)
        return DDPStrategy(cfg, ctx, build_model)
    except ConfigError as error:
        raise TrainingError(str(error)) from None


class DDPStrategy:
    """A whole copy of the model per process; gradients all-reduced in backward."""

    sharded = False  # evaluation needs no collectives: each rank runs its own batches

    def __init__(self, cfg, ctx, build_model):
        self.ctx, self.cfg = ctx, cfg
        self.name = "ddp"
        self.module = build_module(cfg, build_model, ctx.device, on_meta=cfg.init_on_meta)
        self.model = DDP(
            self.module,
            # The device setup_distributed picked: with one visible GPU per process it is
            # cuda:0 whatever LOCAL_RANK is.
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=cfg.find_unused_parameters,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
            bucket_cap_mb=cfg.bucket_cap_mb,
            **{BUFFER_SYNC: buffers_may_differ(self.module)},  # rank 0's buffers, where they may differ
        )
        register_comm_hook(self.model, cfg.comm_hook)
        # --compile: torch.compile goes around the DDP wrapper, so its communication is compiled
        # in step with the graph (PyTorch's documented order); no_sync() still acts on the
        # wrapper. Static shapes (every training batch has the same), as nanochat and the
        # speedrun compile: a shape that changes is compiled again, never made dynamic.
        self.forward_model = torch.compile(self.model, dynamic=False) if cfg.compile else self.model

    def sync_gradients(self, sync):
        """Gradients are all-reduced only on the last micro-step of an optimizer step."""
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def clip_gradients(self, parameters, max_norm):
        return clip_grad_norm(parameters, max_norm)

    def save(self, state, optimizer, checkpoint_dir, cfg):
        """One file, written by rank 0 (checkpoint_files.save_checkpoint)."""
        state = {**state, "model": self.module.state_dict(), "optimizer": optimizer.state_dict()}
        save_checkpoint(
            self.ctx, state, checkpoint_dir, state["step"], cfg.keep_checkpoints, cfg.checkpoint_timeout_seconds
        )

    def load(self, state, path, optimizer):
        if "model" not in state:  # sharded (fsdp): each rank reads the whole model from the shards
            group = checkpoint_group(self.cfg)
            read_sharded_state(self.module, optimizer, path, group)
            dist.destroy_process_group(group)
            return
        self.module.load_state_dict(state["model"])  # unwrapped: no "module." prefix
        parameters = list(self.module.parameters())
        saved = regroup_optimizer_state(state["optimizer"], optimizer, parameters, path)
        if self.ctx.device.type == "cpu":
            # On the CPU, load_state_dict would keep Adam's moments in the checkpoint file's
            # memory map (no copy is needed to reach the device), holding the file, and its disk
            # space once pruned, for the rest of the run.
            saved = copy.deepcopy(saved)
        optimizer.load_state_dict(saved)

    def wait_for_checkpoint(self):
        pass  # saves are synchronous

    def close(self):
        pass


class FSDPStrategy:
    """FSDP2: each shard unit, then the root, keeps 1/N of its parameters, gradients and
    optimizer state per process; checkpoints are sharded too (DCP, one file per rank)."""

    sharded = True  # every forward all-gathers: ranks must run the same number of batches

    def __init__(self, cfg, ctx, build_model):
        # FSDP and DCP are imported here, not at the top: they pull in DTensor and sympy, 1.5 s
        # of start-up per process that ddp runs never need.
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.ctx, self.cfg = ctx, cfg
        amp = AMP_DTYPES[cfg.amp]
        # bf16 parameters for compute; gradients reduced (and kept) in fp32.
        policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32 if amp else None)
        from torch.distributed.device_mesh import init_device_mesh

        replicas = hsdp_replicas(cfg, ctx)
        # Always a mesh on the run's device: given none, fully_shard makes one on torch's
        # accelerator (cuda wherever a GPU is visible, whatever --device says) and moves the
        # parameters there while the group and the batches stay on the CPU.
        # One dimension: shard over every process, on the default group.
        self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        self.name = f"fsdp over {ctx.world_size} process(es)"
        if replicas > 1:
            # Rows of consecutive ranks (a node's processes, as torchrun numbers them) shard;
            # the columns, one rank from each row, replicate. The mesh makes a process group per
            # row and column: with --timeout_seconds, not torch's default (10 or 30 minutes).
            shape, names = (replicas, ctx.world_size // replicas), ("replicate", "shard")
            self.mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names,
                                         backend_override=mesh_group_settings(names, cfg.timeout_seconds))  # fmt: skip
            self.name = f"hsdp: {shape[0]} replicas, each sharded over {shape[1]} process(es)"

        # --cpu_offload: every unit's shards in host memory, page-locked on GPUs (fast copies to
        # and from the device; pinning needs an accelerator, so not on the CPU). The model is
        # then built in host memory too: fully_shard moves one unit at a time to the GPU to
        # shard it, so the whole model is never there at once.
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
        built_on = torch.device("cpu") if cfg.cpu_offload else ctx.device

        def shard(unit):
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy,
                        offload_policy=offload)  # fmt: skip

        self.module = self.model = build_module(cfg, build_model, built_on, on_meta=cfg.init_on_meta, shard=shard)
        # --compile: each shard unit (a block; the model, without any) compiled in place, with
        # static shapes, as torchtitan does; FSDP2's hooks around it (the all-gathers, the
        # reduce-scatter) stay eager. A whole sharded model compiled breaks its graph at every
        # one of those hooks.
        for unit in (shard_units(self.model) or [self.model]) if cfg.compile else ():
            unit.compile(dynamic=False)
        self.forward_model = self.model
        # Checkpoint collectives run on a group of their own: an asynchronous save overlaps
        # the next steps, whose collectives use the default group.
        self.checkpoint_group = checkpoint_group(cfg)
        self.pending = None
        self.stager = None
        if cfg.async_checkpoint:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # An asynchronous save first copies the shards to host memory (then training goes on
            # while a thread writes them): into the same buffers every time, page-locked on GPUs
            # for fast copies, instead of memory allocated afresh for each save. The copy itself
            # is blocking: the next optimizer step must not change what is being copied.
            cuda = ctx.device.type == "cuda"
            options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                     use_non_blocking_copy=False)  # fmt: skip
            self.stager = DefaultStager(options)
            # torch 2.11's stager stages once: a new one for each save there.
            self.new_stager = None if stager_reusable(DefaultStager) else functools.partial(DefaultStager, options)

    def sync_gradients(self, sync):
        """Gradients are reduce-scattered on every micro-step, so each rank only ever holds its
        shard of their sum: left unreduced until the last micro-step, every rank would hold the
        whole model's unsharded fp32 gradient, the memory fsdp is there to save. What
        accumulation saves is the all-reduce between replicas (HSDP), sent on the last
        micro-step only."""
        if self.mesh.ndim > 1:
            self.model.set_requires_all_reduce(sync)
        return contextlib.nullcontext()

    def clip_gradients(self, parameters, max_norm):
        # The gradients are shards (DTensors): the norm is reduced over all of them, and
        # full_tensor() makes it a plain tensor, the same on every rank. With no gradient at
        # all, torch's norm is a plain zero already.
        norm = clip_grad_norm(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def save(self, state, optimizer, checkpoint_dir, cfg):
        """Every rank writes its shards of the model and optimizer state in parallel (DCP);
        with --async_checkpoint the writing overlaps the next steps."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait_for_checkpoint()
        if self.stager is not None and self.new_stager is not None:
            self.stager.close()  # the save it staged for is complete
            self.stager = self.new_stager()
        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        self.pending = save_sharded_checkpoint(
            self.ctx, {"model": model_state, "optimizer": optimizer_state}, state, checkpoint_dir,
            state["step"], cfg.keep_checkpoints, cfg.checkpoint_timeout_seconds, self.checkpoint_group, self.stager,
        )  # fmt: skip
        if not cfg.async_checkpoint:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self):
        """Finish the save in flight, if any: then it is complete and `last` points to it."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finish()

    def close(self):
        """Release the staging buffers (a save in flight keeps what it writes from)."""
        if self.stager is not None:
            self.stager.close()

    def load(self, state, path, optimizer):
        if "model" in state:
            raise CheckpointError(f"checkpoint {path} is one file (--strategy ddp): resume it with --strategy ddp")
        read_sharded_state(self.model, optimizer, path, self.checkpoint_group)


def hsdp_replicas(cfg, ctx):
    """How many replicas --strategy fsdp keeps: --replicate_degree, or one per node when nodes
    run several processes (1: plain FSDP over every process; with one process per node,
    replicas of one process would shard nothing). Each must be a whole number of processes."""
    replicas = cfg.replicate_degree or (ctx.nodes if ctx.local_world_size > 1 else 1)
    if ctx.world_size % replicas:
        raise ConfigError("replicate_degree", f"{replicas} does not divide the {ctx.world_size} processes")
    return replicas


def checkpoint_group(cfg):
    """A gloo group for checkpoint collectives, with --checkpoint_timeout_seconds: a slow file
    system, not a dead peer."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.checkpoint_timeout_seconds))


def mesh_group_settings(names, timeout_seconds):
    """{dimension: (backend, options)} for a device mesh's process groups, with the collective
    timeout of the default group. Each dimension gets its own options object: making a group
    may change the options it is given (NCCL's split does), which must not reach the next."""
    return {name: group_settings(timeout_seconds) for name in names}


def group_settings(timeout_seconds):
    """(backend, options) for a process group made beside the default one, with the collective
    timeout of the default one."""
    backend = dist.get_backend()  # "cuda:nccl,cpu:gloo" with --cpu_offload on GPUs: NCCL's options, gloo takes none
    options = dist.ProcessGroupNCCL.Options() if "nccl" in backend else dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_seconds)
    return backend, options


@contextlib.contextmanager
def unused_parameters_named():
    """DDP notices parameters that got no gradient in the previous step only in the next
    forward, with a long message: say which knob fixes it, in one line."""
    try:
        yield
    except RuntimeError as error:
        if "find_unused_parameters" not in str(error):
            raise
        raise TrainingError(
            "some model parameters received no gradient in the last step, so DDP could not finish its all-reduce: "
            "set --find_unused_parameters true (slower), or run with TORCH_DISTRIBUTED_DEBUG=DETAIL to see which "
            "parameters"
        ) from None


def buffers_may_differ(module):
    """Whether DDP must send rank 0's buffers to every rank before each forward (its default).

    Only buffers that a forward can change differently on each rank need it: an unsynchronised
    BatchNorm's running statistics, or the buffers of any module it cannot see into. A
    synchronised BatchNorm computes the same statistics on every rank from the global batch:
    torch.nn.SyncBatchNorm, or a module that says so with `same_buffers_on_every_rank = True`
    (the vision task's SyncBatchNorm2d). For a model whose buffers are all such (or that has
    none) the broadcast would only cost a collective per forward."""
    owners = [owner for owner in module.modules() if list(owner.buffers(recurse=False))]
    synchronised = (nn.SyncBatchNorm,)
    return any(not (isinstance(o, synchronised) or getattr(o, "same_buffers_on_every_rank", False)) for o in owners)


def load_full_weights(module, weights):
    """Copy a whole state dict, which every rank holds, into the module's parameters and buffers
    in place (each rank keeps its own slice of an fsdp shard): the optimizer keeps the very
    parameters it holds. None: nothing to load."""
    if weights is None:
        return
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            full = weights[name].to(device=tensor.device, dtype=tensor.dtype)
            if hasattr(tensor, "device_mesh"):  # a DTensor shard: this rank's part, cut locally
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.copy_(full)


def model_state_bytes(model, optimizer):
    """Bytes this process holds for the parameters, their gradients (as large as the
    parameters, during a step) and the optimizer state: its shards under fsdp."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    tensors = [*parameters, *parameters]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(local(t).numel() * t.element_size() for t in tensors)
