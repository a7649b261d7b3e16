"""The doctor: check your own model and data on a laptop, before renting GPUs:

    python doctor.py [train.py flags]                    # on the CPU; no GPU needed
    python doctor.py --gpu_memory_gb 40 --nodes 4 --gpus_per_node 8 --batch_size 64

The model and data are the task's (contract.Task, handed over by doctor.py), built from the
same config as training, and each check reports pass, warn or fail, with why and the fix:

  1 vs 2 processes  in float64, a batch's gradients and buffers in this process against 2
              gloo processes under DDP (as training wraps the model) with half of it each,
              then the parameters after 2 AdamW steps of 2 accumulated micro-batches: a batch
              norm without synchronisation, a loss that is not the mean per sample or a
              forward that changes parameters in place shows, named by the first parameter
              that differs (where the 2 processes cannot start, the gradients only, in this
              process: the halves' gradients averaged, as DDP and accumulation make them).
              Compared to 1e-10 of the largest entry, or to float32's rounding where the model
              computes in float32 whatever it is given (a warning naming where: doctor_numerics.py)
  exact resume  two AdamW steps against one, a checkpoint's state loaded into a freshly built
              model, and the second: state kept outside parameters and buffers, or random
              numbers from a generator the model keeps, show
  data position  batch 2 of an epoch read as a run reads it and read first after a resume
              there (the loader as training builds it, with --num_workers and
              --persistent_workers): random numbers that depend on how far the loader has
              read, or an epoch the workers never see, show
  data per rank  the training set as rank 0 and rank 1 of 2 build it (torchrun's variables,
              torch.distributed's answers): data chosen by rank shows
  shard units  the blocks --strategy fsdp shards one by one, and a module nothing initialises
              on the meta device (--init_on_meta)
  fsdp = ddp  one float64 AdamW step of the model under FSDP2 (a group of one process) against
              the plain model's: a parameter used outside the shard unit that holds it shows
  sharded steps  the 1 vs 2 processes steps under fsdp over the 2 processes and under hsdp (2
              replicas): the parameters gathered whole against DDP's
  gradients   one float64 forward and backward on a few training samples: parameters that get
              no gradient (DDP then needs --find_unused_parameters), gradient entries that are
              zero in exact arithmetic (AdamW turns their float32 rounding noise into full
              steps), non-finite values
  memory      bytes per GPU of parameters, gradients, AdamW's state and activations (the peak
              of what a forward and the loss hold, saved for backward or not, measured on a few
              samples under --amp and taken to --batch_size) under ddp, fsdp over every GPU and
              hsdp at the job's world size; whether the configured --strategy fits
              --gpu_memory_gb (GiB, as a GPU's spec sheet counts it: 80 for an "80GB" H100;
              every size printed in binary units, MiB and GiB), and what makes it fit
  checkpoint space  the bytes of a checkpoint and what each rank writes of it (ddp: rank 0 all;
              fsdp: every GPU its shards), and whether --output_dir here holds the
              --keep_checkpoints kept and the one being written (a warning at most: the job's
              own file system is the preflight's to check)
  host syncs  .item(), .tolist(), .cpu() and .numpy() in the forward and loss functions of the
              files that define the task's build_model and build_datasets: each makes the host
              wait for the GPU every step. With a GPU, also a steady-state forward and backward
              under torch.cuda.set_sync_debug_mode

The 2 processes (and --num_workers loader workers) are the doctor's only ones, ended before it
reports. Whole epochs over real data loaders, more processes and real preemptions are what the
project's tests run on your model (tests/test_correctness.py, test_resilience.py, test_fsdp.py).

The report prints as a table and is written to OUTPUT_DIR/doctor.json; the exit status is 1
when a check fails, 2 when the config or data is unusable.
"""

import copy
import dataclasses
import inspect
import json
from pathlib import Path

import torch

from ..configuration import parse_config
from ..core.files import write_atomically
from ..core.logs import first_line, print_error
from ..errors import ConfigError, InputError
from ..knobs import OneLineParser
from ..parallel.model_init import initial_model
from ..train.out_of_memory import plan_settings
from .equivalence import (
    data_position_check,
    equivalence_check,
    fsdp_check,
    rank_data_check,
    resume_check,
)
from .memory import (
    checkpoint_check,
    checkpoint_plan,
    checkpointing_check,
    checkpointing_plan,
    memory_check,
    memory_plan,
)
from .model_checks import gpu_sync_check, gradient_checks, host_sync_check, sharding_check
from .numerics import float64_fix
from .processes import processes_check
from .rows import ERROR_LIMIT, check, halves, to_float64

NODES, GPUS_PER_NODE = {{ cookiecutter.num_nodes | int }}, {{ cookiecutter.gpus_per_node | int }}  # the job's size
SAMPLES = 4  # the activations, 1 vs 2 processes and the resume on this many training samples
GRADIENT_SAMPLES = 16  # each of the two batches of the gradient checks (a ReLU is dead on all 16 1 time in 65536)


def build(task, cfg):
    """The task, its model as training builds it (torch seeded by --seed) and the first
    training samples: a batch of SAMPLES, and two batches of GRADIENT_SAMPLES (the same one
    twice when the training set is small)."""
    train_set, _ = task.build_datasets(cfg)
    if len(train_set) == 0:
        raise InputError("the training set is empty: nothing to check")
    small = next(iter(torch.utils.data.DataLoader(train_set, batch_size=min(SAMPLES, len(train_set)))))
    loader = iter(torch.utils.data.DataLoader(train_set, batch_size=min(GRADIENT_SAMPLES, len(train_set))))
    first = next(loader)
    second = next(loader, first) if len(train_set) >= 2 * GRADIENT_SAMPLES else first
    return built(task, cfg), small, (first, second)


def built(task, cfg):
    """The model as training builds it, on the CPU (the generators left as they were): with
    training's own function (model_init.initial_model), so its initial weights are training's,
    a model's init_weights and --init_on_meta included; before its activation checkpointing
    (the doctor measures each mode on copies) and its strategy. A model the meta start cannot
    reach is built as its own code makes it, here only: the shard units row names what fails."""
    try:
        return initial_model(cfg, task.build_model, torch.device("cpu"), on_meta=cfg.init_on_meta)
    except ConfigError:
        return initial_model(cfg, task.build_model, torch.device("cpu"))


def diagnose(task, cfg, gpu_gb, world_size, gpus_per_node):
    # Every check but the GPU's runs on this machine's CPU (gloo processes, float64): the model
    # as --device cpu builds it, also where a GPU is visible (a task may pick GPU-only layers,
    # such as torch's SyncBatchNorm, for a run on GPUs).
    gpu_cfg, cfg = cfg, dataclasses.replace(cfg, device="cpu")
    model, small, batches = build(task, cfg)
    modes = checkpointing_plan(model, small, task.loss_fn, cfg)  # each mode's activations, measured once
    measured = modes.get(cfg.activation_checkpointing, {}).get("activations")
    plans, flags, configured = memory_plan(model, small, task.loss_fn, cfg, world_size, gpus_per_node, measured)
    checkpointing = checkpointing_check(modes, plans, configured, cfg, gpu_gb)
    fix = checkpointing["fix"]  # the mode that fits, where one does: the memory plan's row names the same
    named = fix.split(" (")[0] if checkpointing["status"] == "warn" and fix.startswith("--activation") else None
    rows = [memory_check(plans, flags, configured, cfg, gpu_gb, world_size, named), checkpointing]
    checkpoints = checkpoint_plan(model, cfg, world_size)
    rows.append(checkpoint_check(checkpoints, cfg, world_size))
    if torch.cuda.is_available():
        rows.append(gpu_sync_check(built(task, gpu_cfg), small, task.loss_fn, gpu_cfg))
    small = to_float64(small)  # the steps below on SAMPLES samples: a float64 step of a large model is slow
    processes = attempt("1 vs 2 processes", processes_check, task.build_model, small, task.loss_fn, cfg)
    if len(processes) > 1:
        sharded = processes[1]
    else:  # the processes did not run: why, and what to do, from their row
        sharded = check("sharded steps", "warn", processes[0]["summary"], processes[0]["fix"])
    if not_run(processes[0]):  # the processes could not run here: the same arithmetic in this one
        processes = attempt("1 vs 2 processes", equivalence_check, copy.deepcopy(model).double(), small, task.loss_fn)
        processes[0]["summary"] = f"in one process: {processes[0]['summary']}"
    rows.append(processes[0])
    rows += attempt("exact resume", resume_check, lambda: built(task, cfg), halves(small), task.loss_fn, cfg)
    rows += [data_position_check(task, cfg), rank_data_check(task, cfg)]
    rows += attempt("shard units", sharding_check, task.build_model, model, cfg)
    rows += [fsdp_check(task.build_model, small, task.loss_fn, cfg), sharded]
    rows += attempt("gradients", gradient_checks, model, batches, task.loss_fn, cfg)  # last: the model to float64
    rows.append(host_sync_check(source_files(task)))
    return rows, {"per_gpu": plans, "configured": configured, "activation_checkpointing": modes}, checkpoints


def not_run(row):
    """Whether processes_check's row says its processes did not run (or DDP refused the model)."""
    return row["status"] == "warn" and (row["summary"].startswith("not checked") or " raises " in row["summary"])


def source_files(task):
    """The files that define the task's model and datasets (model.py and dataset.py, as a rule)."""
    files = {}
    for function in (task.build_model, task.build_datasets):
        try:
            files[Path(inspect.getsourcefile(function))] = None
        except TypeError:  # a builtin or a C extension: no source to read
            pass
    return list(files)


def attempt(name, run, *args):
    """The rows of `run(*args)`, or one that says what the model raised (in float64, say):
    the report goes on to the other checks."""
    try:
        rows = run(*args)
    except InputError:
        raise
    except Exception as error:
        why = f"not checked: it raises {type(error).__name__}: {first_line(error, ERROR_LIMIT)}"
        return [check(name, "warn", why, float64_fix(error))]
    return rows if isinstance(rows, list) else [rows]


def table(rows):
    lines = ["| check | status | why | fix |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['status'].upper()} | {r['summary']} | {r['fix']} |" for r in rows]
    return "\n".join(lines)


def main(task, argv=None):
    """The doctor of `task` (contract.Task) with the flags in `argv`; returns the exit code."""
    parser = OneLineParser(add_help=False, description="The doctor's own flags (train.py's follow):")
    parser.add_argument(
        "--gpu_memory_gb",
        type=float,
        default=80.0,
        help="memory of one GPU of the job in GiB (2**30 bytes), as its spec sheet says it: 80 for an 80GB H100 "
        "(default %(default)g)",
    )
    parser.add_argument("--nodes", type=int, default=NODES, help="nodes of the job (default %(default)s)")
    parser.add_argument(
        "--gpus_per_node", type=int, default=GPUS_PER_NODE, help="GPUs of each node (default %(default)s)"
    )
    own, rest = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        print(parser.format_help())  # then train.py's flags, from parse_config
    for name in ("gpu_memory_gb", "nodes", "gpus_per_node"):
        if not getattr(own, name) > 0:
            print_error(f"--{name} {getattr(own, name)}: must be positive")
            return 2
    cfg = parse_config(task.config, rest)
    try:
        rows, memory, checkpoints = diagnose(
            task, cfg, own.gpu_memory_gb, own.nodes * own.gpus_per_node, own.gpus_per_node
        )
    except InputError as error:
        print_error(str(error))
        return 2
    print(table(rows))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"checks": rows, "memory_bytes_per_gpu": memory["per_gpu"], "configured": memory["configured"],
              "activation_checkpointing": memory["activation_checkpointing"], "checkpoint_bytes_per_rank": checkpoints,
              "gpu_memory_gb": own.gpu_memory_gb, "world_size": own.nodes * own.gpus_per_node,
              "settings": plan_settings(cfg)}  # fmt: skip
    # Never a half-written report.
    write_atomically(out / "doctor.json", lambda f: f.write(json.dumps(report, indent=2) + "\n"), "w")
    print(f"\nwritten to {out / 'doctor.json'}")
    return 1 if any(row["status"] == "fail" for row in rows) else 0
