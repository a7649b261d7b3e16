"""Yours: every knob of a training run, in one place: the fields below, plus the model's
(ModelConfig in model.py) and the data's (DataConfig in dataset.py), next to the code they
configure. The parser and the checks across fields are machinery (ddp_utils/configuration.py).

Edit the defaults here, keep an experiment's settings in a TOML file, or override any field on
the command line; the last wins (defaults, then the file, then the flags):

    python train.py --config experiments/quick_cpu.toml --lr 0.001

`python train.py --help` lists every field. Field names are a stable contract: config files,
scripts, sweeps and the checkpoint's saved config refer to them by name. Each run writes its
resolved config to output_dir/config.toml, which reproduces it.
"""

from dataclasses import dataclass

from dataset import DataConfig
from ddp_utils.configuration import RunConfig
from ddp_utils.knobs import knob
from ddp_utils.parallel.activation_checkpointing import ALIASES as AC_ALIASES
from ddp_utils.parallel.activation_checkpointing import MODES as AC_MODES
from ddp_utils.parallel.comm_hooks import COMM_HOOKS
from model import ModelConfig


@dataclass(frozen=True)
class Config(RunConfig, ModelConfig, DataConfig):
    # Run
    seed: int = knob(0, "seed of everything random: model init, data order, augmentation")
    epochs: int = knob(10, "passes over the training set (when max_steps is 0)")
    max_steps: int = knob(0, "optimizer steps to train, across epochs; 0 = train epochs")
    eval_every_steps: int = knob(0, "evaluate (one metrics.jsonl line) every N optimizer steps, 0 = at epoch ends")
    output_dir: str = knob("runs/default", "folder for train.log, metrics.jsonl and checkpoints/")
    resume: str = knob(
        "auto",
        "'auto': continue from output_dir/checkpoints/last.pt if present, 'none': start fresh, or a checkpoint path",
    )

    # Data loading (the data itself: DataConfig in dataset.py)
    num_workers: int = knob(0, "DataLoader worker processes per training process")
    persistent_workers: bool = knob(
        True, "keep DataLoader workers alive across epochs and evaluations, started before training (num_workers > 0)"
    )
    prefetch_factor: int = knob(2, "batches each DataLoader worker loads ahead (with num_workers > 0)")
    skip_bad_files: bool = knob(
        False, "train without the samples the data's check finds bad (a corrupt image), rather than stop"
    )
    # Data in shards (--data_dir s3://bucket/prefix, or a folder with index.json: docs/streaming.md)
    stream_cache_dir: str = knob("", "node-local folder caching shards read from a URL, '' = the system's temp folder")
    stream_cache_gb: float = knob(20.0, "most GiB of shards the cache keeps per node (least recently used evicted)")
    stream_shuffle_shards: int = knob(8, "shards whose samples an epoch shuffles together (all in the cache at once)")

    # Optimisation
    batch_size: int = knob(
        64, "samples per process per micro-step; global batch = batch_size x processes x grad_accum_steps"
    )
    grad_accum_steps: int = knob(1, "micro-steps per optimizer step")
    lr: float = knob(1e-3, "peak learning rate, used as given (never rescaled by the world size)")
    optimizer: str = knob(
        "adamw", "adamw, or muon: Muon for the hidden weight matrices, AdamW for the rest (docs/optimizers.md)",
        ("adamw", "muon"),
    )  # fmt: skip
    muon_lr: float = knob(
        0.01, "--optimizer muon: peak learning rate of Muon's matrices (the other parameters: --lr), same schedule"
    )
    weight_decay: float = knob(0.01, "decoupled weight decay of matrices (AdamW's, and Muon's)")
    muon_momentum: float = knob(0.95, "--optimizer muon: Muon's Nesterov momentum")
    muon_ns_steps: int = knob(5, "--optimizer muon: Newton-Schulz iterations that orthogonalise each update")
    max_grad_norm: float = knob(1.0, "clip the global gradient norm to this, 0 = off")
    lr_schedule: str = knob("cosine", "learning-rate decay after warmup", ("cosine", "constant"))
    warmup_steps: int = knob(0, "optimizer steps of linear warmup from 0 to lr (at the run's first global batch)")
    min_lr_ratio: float = knob(0.1, "cosine decays to lr x this at the last step")
    min_loss_scale: float = knob(1.0, "fp16: stop when the loss scale falls below this")
    max_skipped_steps: int = knob(20, "fp16: stop after this many overflow-skipped steps in a row, 0 = never")
    amp: str = knob(
        {{ cookiecutter.amp | tojson }},
        "mixed precision: bf16 or fp16 autocast (fp16 with loss scaling), or none",
        ("bf16", "fp16", "none"),
    )

    # Speed
    compile: bool = knob(False, "torch.compile the DDP-wrapped model (PyTorch's documented order)")
    activation_checkpointing: str = knob(
        "none",
        "recompute the blocks' activations in backward instead of keeping them: less memory, more compute "
        "(full: every block; every_other: half of them; ops: keep matmul and attention outputs only)",
        AC_MODES,
        aliases=AC_ALIASES,
    )
    tf32: bool = knob(True, "allow TF32 matmuls and convolutions on GPUs that have them")
    gradient_as_bucket_view: bool = knob(True, "gradients as views of DDP's buckets: saves a copy and memory")
    static_graph: bool = knob(False, "tell DDP the graph is the same every step (enables more overlap)")
    bucket_cap_mb: int = knob(25, "size of DDP's gradient buckets in MiB")
    comm_hook: str = knob("none", "compress gradients before all-reduce, for slow inter-node links", COMM_HOOKS)

    # Checkpoints and logging
    checkpoint_every_steps: int = knob(0, "also checkpoint every N optimizer steps, 0 = epoch ends only")
    checkpoint_timeout_seconds: int = knob(
        1800, "limit for writing or reading a checkpoint while the other ranks wait (slow network file systems)"
    )
    keep_checkpoints: int = knob(3, "newest step checkpoints kept besides last.pt")
    log_every_steps: int = knob(50, "log the training loss every N optimizer steps, 0 = off")
    sample_every_steps: int = knob(0, "rank 0 logs a sample of the model's output every N steps (sample_text), 0 = off")
    progress_bar: bool = knob(True, "tqdm progress bar on rank 0 when stdout is a terminal")
    progress_every_seconds: float = knob(
        30.0, "without a progress bar, rank 0 prints step, loss and time left at least this often, 0 = off"
    )
    tracker: str = knob(
        "none",
        "where metrics also go, from rank 0: none, tensorboard (output_dir/tensorboard), wandb, mlflow, "
        "or a comma list such as tensorboard,wandb (docs/performance.md)",
    )
    tracker_project: str = knob({{ cookiecutter.project_slug | tojson }}, "W&B project and MLflow experiment of the run")
    profile_steps: str = knob(
        "", "record optimizer steps A:B (e.g. 10:12) on rank 0 with torch.profiler into output_dir/profile/, '' = off"
    )
    peak_tflops: float = knob(0.0, "peak TFLOPS of one GPU for the MFU estimate, 0 = look up the GPU")

    # Distributed
    strategy: str = knob(
        "ddp",
        "ddp: a whole copy of the model per process; fsdp: each process keeps 1/N of the parameters, "
        "gradients and optimizer state (docs/sharding.md)",
        ("ddp", "fsdp"),
    )
    replicate_degree: int = knob(
        0,
        "fsdp: keep N replicas, each sharded over world size / N processes (hybrid sharding, HSDP): all-gathers "
        "stay within a replica, only gradients cross between them; 0 = one replica per node, 1 = shard over all",
    )
    reshard_after_forward: bool = knob(
        True, "fsdp: free each block's gathered parameters after its forward (less memory, one more all-gather)"
    )
    cpu_offload: bool = knob(
        False,
        "fsdp: keep the parameters, gradients and optimizer state in host memory and step the optimizer there "
        "(GPU memory for the model state, for host-GPU copies every step and a CPU optimizer step; docs/sharding.md)",
    )
    init_on_meta: bool = knob(False, "build the model on the meta device, then initialise it module by module")
    async_checkpoint: bool = knob(False, "fsdp: write checkpoints in the background while training goes on")
    device: str = knob(
        "auto",
        "auto: each process's GPU when CUDA works, else the CPU, but stop when GPUs were asked for "
        "(CUDA_VISIBLE_DEVICES, SLURM) and CUDA cannot use them; cuda: stop without a usable GPU; cpu: the CPU",
        ("auto", "cuda", "cpu"),
    )
    timeout_seconds: int = knob(600, "limit for process-group start-up and each collective")
    find_unused_parameters: bool = knob(
        False, "let DDP handle parameters that get no gradient in a step (slower; docs/your-model.md)"
    )
