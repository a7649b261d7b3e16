"""doctor.py's 1 vs 2 processes for real: the model as training wraps it in 2 gloo processes
(DDP, then fsdp and hsdp) against this process, in float64. A backward's gradients and
buffers, then the parameters after optimizer steps of accumulated micro-batches. The
processes are the doctor's only ones, spawned here and gone when processes_check returns."""

import contextlib
import dataclasses
import json
import os
import pickle  # nosec B403  # loads only its own job file (rank_main)
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from ..contract import count_samples, model_inputs
from ..core.files import write_atomically
from ..core.logs import first_line
from ..distributed.process_group import DistContext
from ..errors import ConfigError
from ..optim.optimizer import build_optimizer, clip_grad_norm
from ..parallel.model_init import build_module
from ..parallel.strategy import build_strategy
from .equivalence import (
    FSDP_FIX,
    IN_PLACE_FIX,
    cause_of_difference,
    changed_in_place,
    generators_kept,
    without_dropout,
)
from .numerics import EXACT, Tolerance, watching_casts
from .rows import ERROR_LIMIT, check, halves, whole


def processes_check(build_model, batch, loss_fn, cfg):
    """The real thing, in float64: 2 gloo processes with half of `batch` each against this
    one with all of it, the model wrapped as training wraps it (DDP, its buffer broadcast,
    synchronised batch norms really synchronising). Dropout is off, as in equivalence_check.
    Rows:
    - "1 vs 2 processes": one forward and backward (the gradients DDP averaged, and the
      buffers), then STEPS AdamW steps of ACCUMULATION micro-batches each as train.py takes
      them (no all-reduce but on the last, the loss divided, the gradients clipped): the
      parameters and buffers after them.
    - "sharded steps": the same steps under fsdp over the 2 processes and under hsdp (2
      replicas of one process), the parameters gathered whole against DDP's.
    The processes are spawned and gone when it returns (killed if they have not ended in
    PROCESSES_TIMEOUT s). A model with torch's SyncBatchNorm, which DDP refuses on the CPU,
    gets warnings: doctor.py then checks it in one process (equivalence_check)."""
    shares = halves(batch)
    if count_samples(shares[0]) == 0:
        why = "not checked: the training set has fewer than 2 samples"
        return [check("1 vs 2 processes", "warn", why), check("sharded steps", "warn", why)]
    # DDP's stages without fsdp's --cpu_offload (refused under ddp); fsdp's and hsdp's keep it.
    stages = {"gradients": dataclasses.replace(cfg, strategy="ddp", amp="none", comm_hook="none",
                                               find_unused_parameters=True, cpu_offload=False)}  # fmt: skip
    micro = micro_batches(batch)
    if micro:
        stages["ddp"] = stages["gradients"]
        for name, replicas in (("fsdp", 1), ("hsdp", 2)):
            with contextlib.suppress(ConfigError):  # fsdp_check's row names the setting fsdp refuses
                stages[name] = dataclasses.replace(cfg, strategy="fsdp", amp="none", replicate_degree=replicas,
                                                   async_checkpoint=False)  # fmt: skip
    with generators_kept():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            full = tree_map_only(torch.Tensor, lambda t: t[: 2 * count_samples(shares[0])], batch)
            with watching_casts() as watch:  # what the model computes in a lower precision
                model = reference(
                    stages["gradients"], build_model, lambda m: loss_fn(m(model_inputs(full)), full).backward()
                )
            gradients = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            tolerance = Tolerance.watched(model, watch)
            expected = {"gradients": {"gradient": gradients, "buffer": dict(model.named_buffers())}}
            if any(isinstance(module, nn.SyncBatchNorm) for module in model.modules()):
                why = "not checked: DDP on the CPU refuses nn.SyncBatchNorm (GPU modules only)"
                return [check("1 vs 2 processes", "warn", why), check("sharded steps", "warn", why)]
            if micro:
                stepped = reference(stages["ddp"], build_model, lambda m: train_steps(m, stages["ddp"], micro, loss_fn))
                expected["ddp"] = {
                    "parameter": dict(stepped.named_parameters()),
                    "buffer": dict(stepped.named_buffers()),
                }
        finally:
            torch.set_default_dtype(previous)
    job = {"stages": stages, "build_model": build_model, "loss_fn": loss_fn, "shares": shares,
           "micro": [[halves(m)[rank] for m in micro] for rank in (0, 1)]}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        problem = run_processes(folder, job)
        results = {stage: torch.load(folder / f"{stage}.pt", weights_only=True)
                   for stage in stages if (folder / f"{stage}.pt").exists()}  # fmt: skip
    compared = (tolerance, tolerance.noise(gradients))  # entries at the noise level: the zero gradients row's
    ddp = stage_row("1 vs 2 processes", ["gradients", "ddp"], expected, results, problem, model, batch, cfg, compared)
    if not micro:
        return [ddp, check("sharded steps", "warn", "not checked: the training set has fewer than 4 samples")]
    if "ddp" not in results:
        why = "not checked: the 2 processes' steps under DDP, which fsdp and hsdp must equal, did not finish"
        return [ddp, check("sharded steps", "warn", why)]
    expected.update({stage: results["ddp"] for stage in ("fsdp", "hsdp") if stage in stages})
    sharded = stage_row("sharded steps", ["fsdp", "hsdp"], expected, results, problem, model, batch, cfg, compared)
    return [ddp, sharded]


ACCUMULATION, STEPS = 2, 2  # the steps of processes_check: each of this many micro-batches per rank
PROCESSES_TIMEOUT = 300  # seconds for the 2 processes of processes_check: spawned, they import torch first
STAGES = {  # what each stage of processes_check runs, for its rows
    "gradients": "a backward under DDP",
    "ddp": f"{STEPS} steps under DDP",
    "fsdp": f"{STEPS} steps under fsdp over 2 processes",
    "hsdp": f"{STEPS} steps under hsdp, 2 replicas",
}


def micro_batches(batch):
    """ACCUMULATION equal parts of `batch`, each split in halves between the ranks (an empty
    list where it is too small for that)."""
    size = count_samples(batch) // (2 * ACCUMULATION)
    if size == 0:
        return []
    return [tree_map_only(torch.Tensor, lambda t, i=i: t[i * 2 * size : (i + 1) * 2 * size], batch)
            for i in range(ACCUMULATION)]  # fmt: skip


def train_steps(model, cfg, micro, loss_fn, sync=lambda last: contextlib.nullcontext(), clip=clip_grad_norm):
    """STEPS AdamW steps of the micro-batches `micro` each, as train.py takes them: the loss
    divided by their number, gradients synchronised on the last (`sync`), clipped to
    --max_grad_norm."""
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    for _ in range(STEPS):
        for index, batch in enumerate(micro):
            with sync(index == len(micro) - 1):
                (loss_fn(model(model_inputs(batch)), batch) / len(micro)).backward()
        if cfg.max_grad_norm > 0:
            clip([p for p in model.parameters() if p.grad is not None], cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def reference(cfg, build_model, run):
    """The model as build_module makes it, in this process, after `run(model)` (dropout off)."""
    model = build_module(cfg, build_model, torch.device("cpu"), on_meta=cfg.init_on_meta)
    without_dropout(model)
    run(model)
    return model


def stage_row(name, stages, expected, results, problem, model, batch, cfg, compared):
    """The row `name` of processes_check for `stages`: the first that raised or differs from
    `expected`, in order, fails; a stage not run (the processes did not finish) makes it a
    warning, and one that agrees only to the rounding of a precision the model casts to too.
    `compared`: the Tolerance, and the parameter entries left out after steps (noise)."""
    tolerance, noise = compared
    done, close = [], None
    for stage in stages:
        if stage not in expected:  # fsdp refuses the config: fsdp_check's row says why
            continue
        if stage not in results:
            if problem and problem[0] == stage and problem[1]:
                refused = problem[1] == "TrainingError" and cfg.strategy != "fsdp"
                why = f"{STAGES[stage]}, rank {problem[2]} raises {problem[1]}: {problem[3]}"
                return check(name, "warn" if refused else "fail", why, FSDP_FIX if stage in ("fsdp", "hsdp") else "")
            why = f"not checked: the 2 processes did not finish {STAGES[stage]} ({problem[3] if problem else ''})"
            return check(name, "warn", why[:300])
        for kind, tensors in expected[stage].items():
            left_out = noise if kind == "parameter" else None
            verdict, which = tolerance.compare(tensors, results[stage].get(kind, {}), left_out)
            if verdict == "differs":
                return difference_row(name, stage, f"{which}'s {kind}", model, batch)
            close = close or (verdict == "close" and f"{STAGES[stage]}: the {kind}s")
        done.append(stage)
    if close:
        return check(name, "warn", *tolerance.close_row(close))
    if name == "1 vs 2 processes":
        steps = f", and parameters after {STEPS} AdamW steps of {ACCUMULATION} accumulated micro-batches"
        steps = steps if "ddp" in done else ""
        why = f"2 gloo processes under DDP and 1 agree to {EXACT:g} (float64): gradients, buffers{steps}"
        return check(name, "pass", why)
    if not done:
        return check(name, "warn", "not checked: --strategy fsdp refuses this config (see fsdp = ddp)")
    under = " and ".join({"fsdp": "fsdp (sharded over 2 gloo processes)", "hsdp": "hsdp (2 replicas)"}[s] for s in done)
    why = f"{STEPS} AdamW steps of {ACCUMULATION} accumulated micro-batches under {under} equal DDP's to {EXACT:g}"
    return check(name, "pass", why)


def difference_row(name, stage, what, model, batch):
    """The fail of `what` differing after `stage`, with its likely cause: for fsdp and hsdp
    against DDP, a forward that changes a parameter in place, else a parameter used outside
    its shard unit."""
    if stage in ("fsdp", "hsdp"):
        changed = changed_in_place(model, batch)
        if not changed:
            why = f"{what} differs after {STAGES[stage]} from DDP's: a parameter used outside its shard unit"
            return check(name, "fail", why, FSDP_FIX)
        return check(name, "fail", f"{what} differs after {STAGES[stage]} from DDP's: the forward changes {changed} "
                     "in place (under fsdp, in a copy gathered for it and then freed)", IN_PLACE_FIX)  # fmt: skip
    cause, fix = cause_of_difference(model, batch)
    return check(name, "fail", f"{what} differs after {STAGES[stage]}: {cause}", fix)


def run_processes(folder, job):
    """processes_check's 2 processes, on `job` (pickled to FOLDER/job.pkl): None when both ended
    well, else (stage, the error type it raised or None, rank, why): the first error raised
    (the other rank's is then often only the lost connection), or the first process that
    ended otherwise, or the timeout."""
    (folder / "path.json").write_text(json.dumps(sys.path))  # where this process finds the model's code
    with open(folder / "job.pkl", "wb") as file:
        pickle.dump(job, file)
    processes = []
    try:
        for rank in (0, 1):
            with open(folder / f"rank{rank}.log", "w") as log:  # torch's own lines stay out of the report
                processes.append(subprocess.Popen([sys.executable, "-c", RANK_MAIN, str(folder), str(rank)],
                                                  stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + PROCESSES_TIMEOUT
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in processes):
                break  # one failed: the other would wait for it in a collective
            time.sleep(0.05)
        ended = [(rank, p.returncode) for rank, p in enumerate(processes) if p.poll() not in (None, 0)]
    finally:
        for process in processes:
            process.kill()  # one that has exited is left as it is
            process.wait()
    unfinished = next((stage for stage in job["stages"] if not (folder / f"{stage}.pt").exists()), None)
    errors = [json.loads(path.read_text()) for path in folder.glob("rank*.error")]
    if errors:
        return tuple(min(errors, key=lambda error: error[-1])[:-1])  # the earliest
    if ended:
        log = (folder / f"rank{ended[0][0]}.log").read_text().strip().splitlines()
        return (unfinished, None, ended[0][0], log[-1] if log else f"exit status {ended[0][1]}")
    if unfinished is None:
        return None
    return (unfinished, None, 0, f"{PROCESSES_TIMEOUT} s")


# The command of each of processes_check's 2 processes: the model's code found as this process
# finds it, then rank_main.


RANK_MAIN = (
    "import json, sys; sys.path[:0] = json.load(open(sys.argv[1] + '/path.json')); "
    "from ddp_utils.doctor import processes as d; d.rank_main(sys.argv[1], int(sys.argv[2]))"
)


def rank_main(folder, rank):
    """One of processes_check's 2 processes: each stage of the job in turn, its results from
    rank 0 to FOLDER/<stage>.pt; what it raised to FOLDER/rank<N>.error."""
    folder, stage = Path(folder), None
    parent = os.getppid()
    threading.Thread(target=end_when_orphaned, args=(parent,), name="orphaned", daemon=True).start()
    try:
        # The job is no outside data: this process's parent pickled it (run_processes) into the
        # temporary folder it made for these two processes, which only its user can write to
        # (mode 0700). Pickle, not torch.load's weights_only: the job holds the model's code (its
        # build function, the loss).
        with open(folder / "job.pkl", "rb") as file:
            job = pickle.load(file)  # nosec B301  # the parent's own file (above)
        torch.set_default_dtype(torch.float64)
        store = dist.FileStore(str(folder / "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        cpu = torch.device("cpu")
        context = DistContext(rank=rank, local_rank=rank, world_size=2, device=cpu, store=store, local_world_size=2)
        for stage, cfg in job["stages"].items():
            strategy = build_strategy(cfg, context, job["build_model"])
            without_dropout(strategy.module)
            if stage == "gradients":
                share = job["shares"][rank]
                job["loss_fn"](strategy.model(model_inputs(share)), share).backward()
                params = {n: p.grad for n, p in strategy.module.named_parameters() if p.grad is not None}
                result = {"gradient": params, "buffer": dict(strategy.module.named_buffers())}
            else:
                train_steps(strategy.model, cfg, job["micro"][rank], job["loss_fn"], strategy.sync_gradients,
                            strategy.clip_gradients)  # fmt: skip
                params = {n: whole(p) for n, p in strategy.module.named_parameters()}  # a collective for shards
                result = {"parameter": params, "buffer": {n: whole(b) for n, b in strategy.module.named_buffers()}}
            strategy.close()
            if rank == 0:
                write_atomically(folder / f"{stage}.pt", lambda f, result=result: torch.save(result, f))
        dist.destroy_process_group()
    except Exception as error:
        error = [stage, type(error).__name__, rank, first_line(error, ERROR_LIMIT), time.time()]
        (folder / f"rank{rank}.error").write_text(json.dumps(error))
        sys.exit(1)


def end_when_orphaned(parent):
    """A rank whose doctor has gone (killed, say, where its cleanup cannot run) ends too,
    instead of waiting for the other in a collective for gloo's 30 minutes."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)
