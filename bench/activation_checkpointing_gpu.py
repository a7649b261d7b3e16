"""Issue 63's GPU plan: --activation_checkpointing on the language task's GPT (12 layers x 768,
1024-token windows, 64 a micro-step: the anchors' 64 x 1024 tokens), bf16, one GPU, each mode
(none, full, every_other, ops) trained by the project's own Trainer (ddp_utils/train/trainer.py,
a group of one process) in this process. Run in the baked language project's folder:

    python bench/activation_checkpointing_gpu.py --part steady --data_dir DIR          # bench/gpu_check.sh check 24
    python bench/activation_checkpointing_gpu.py --part offload,search --data_dir DIR  # check 23
    .venv/bin/python bench/activation_checkpointing_gpu.py --tiny   # here, no GPU: a bake, tiny sizes, every part

The parts (each prints a Markdown table, and a `ROW<tab>name<tab>result` line per result that
bench/gpu_check.sh turns into its rows):

- steady: --compile true (as train.py compiles: the DDP-wrapped model, dynamic=False), per mode
  --warmup steps (the first compiles), then --steps timed ones: tokens/s, the peak GPU memory of
  a step (torch.cuda.max_memory_allocated: parameters, AdamW's state, DDP's buckets, the
  activations), and the activations measured (the peak of a step's forward and backward above
  what was allocated before it), against the doctor's plan for the mode (below). Targets: the
  doctor within 20% of the measured activations; full at most 1/3 of none's activations at
  no more than 1.4x its step time.
- search: the largest micro-batch that fits, per mode, without compile (a compiled run would
  compile every size again: train.py compiles with dynamic=False): two steps at the batch of
  the job (its eager activations beside the doctor's plan), then at twice the last that fit
  until one runs out of memory (or --max_batch), then halving the gap to 1/8 of the fitting
  batch, at most --search_seconds a mode; each size two steps (forward, backward, optimizer
  step). After an out-of-memory error the mode's Trainer is built afresh (DDP's reducer does not
  survive a failed backward).
- offload: --strategy fsdp without and with --cpu_offload, --activation_checkpointing none, no
  compile: the median step time of --offload_steps steps after --offload_warmup, tokens/s, peak
  GPU memory. Run before the doctor's CPU processes start (the offloaded optimizer steps on the CPU).
- The doctor's plan: ddp_utils/doctor/memory.py's memory_plan (what doctor.py writes to
  doctor.json's memory_bytes_per_gpu), ddp's activations per mode at --batch_size, measured as the
  doctor does on the CPU (its 4 samples under CPU autocast, taken to --batch_size); the rest of
  doctor.py (float64 steps of the whole model, 2 processes) is left out: minutes of CPU at this
  size. One CPU process per mode, started with the first part that needs it and run beside the
  GPU's work (CUDA hidden), the results kept in --doctor_cache (a later command on the same
  machine reads them).

Each part stops starting new work when --seconds are nearly spent, and says what it did not run.
Nothing is downloaded: the data is the bake's (prepare_data.py's byte tokens). A benchmark, not a
test: it asserts nothing; a row is FAILED only where the run itself failed.
"""

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from activation_checkpointing import MODES, batches_of, build_trainer, close_trainer, project_flags

GPT = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "batch_size": 64}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch_size": 4}
# --tiny on the CPU has no memory to run out of: these many samples a micro-batch (by mode) raise
# torch.OutOfMemoryError in the forward, so the search's path runs as on a GPU.
TINY_CAPACITY = {"none": 6, "full": 14, "every_other": 9, "ops": 8}
GIB = 2**30
# What a failed run raises: torch's errors (compile's too) are RuntimeErrors; a config refused is a ValueError.
FAILURES = (RuntimeError, ValueError, TypeError, AttributeError, KeyError, AssertionError, OSError)


def row(name, result):
    """A result for bench/gpu_check.sh: "ok (...)" or what went wrong (tabs and newlines flattened)."""
    text = " ".join(str(result).split())
    print(f"ROW\t{name}\t{text}", flush=True)


def failure_text(error):
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def gib(value):
    """Bytes in, or in MiB below a tenth of one (--tiny's sizes)."""
    if value is None:
        return "-"
    return f"{value / GIB:.2f}" if value >= GIB / 10 else f"{value / 2**20:.1f} MiB"


def met(ok):
    return "met" if ok else "NOT met"


class Gauge:
    """The GPU's allocated bytes and their peak since the last reset (None on the CPU)."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def reset(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def allocated(self):
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def peak(self):
        return self.torch.cuda.max_memory_allocated() if self.cuda else None

    def synchronize(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


class Run:
    """One part's setting: the task, the process group, the data, the flags, the deadline."""

    def __init__(self, args, host_collectives=False):
        sys.path.insert(0, os.getcwd())
        import torch
        from ddp_utils.distributed.process_group import setup_distributed
        from ddp_utils.train.inputs import check_inputs
        from task import TASK

        self.args, self.torch, self.task = args, torch, TASK
        self.deadline = time.monotonic() + args.seconds
        self.sizes = {name: getattr(args, name) for name in GPT}
        self.work = Path(tempfile.mkdtemp(prefix="ac-gpu-"))
        cfg = self.config()
        extra = {"host_collectives": True} if host_collectives else {}
        self.ctx = setup_distributed(cfg.timeout_seconds, device=cfg.device, **extra)
        self.gauge = Gauge(self.ctx.device)
        self.datasets = check_inputs(TASK, cfg, self.ctx)[0]
        self.tokens = args.block_size  # a sample's tokens
        self.job = f"GPT {args.n_layer}x{args.n_embd} {args.batch_size}x{args.block_size} {args.amp}"

    def flags(self, **settings):
        settings = {"amp": self.args.amp, "device": self.args.device, "output_dir": self.work / "run", **settings}
        return project_flags(self.sizes, self.args.data_dir, **settings)

    def config(self, **settings):
        from ddp_utils.configuration import parse_config

        return parse_config(self.task.config, self.flags(**settings))

    def left(self):
        return self.deadline - time.monotonic()

    def trainer(self, name, **settings):
        settings = {"output_dir": self.work / name, **settings}
        trainer = build_trainer(self.task, self.flags(**settings), self.ctx, self.datasets)
        if self.args.tiny and self.ctx.device.type == "cpu":  # the search's out-of-memory path, on the CPU
            capacity = TINY_CAPACITY[trainer.cfg.activation_checkpointing]

            def out_of_memory(module, inputs):
                if inputs[0].shape[0] > capacity:
                    raise self.torch.OutOfMemoryError(f"--tiny: more than {capacity} samples (a stand-in)")

            trainer.strategy.module.register_forward_pre_hook(out_of_memory)
        return trainer

    def batches(self, trainer, samples, count):
        return batches_of(self.datasets[0], trainer.train_loader.collate_fn, samples, count)

    def step(self, trainer, batch):
        """One training step: (the activations' peak above what was allocated before the forward,
        the step's peak) in bytes, None on the CPU."""
        trainer.watchdog.beat(f"bench step {trainer.step + 1}")
        self.gauge.reset()
        before = self.gauge.allocated()
        trainer.train_step(batch, sync=True)
        activations = None if before is None else self.gauge.peak() - before
        trainer.optimizer_step()
        return activations, self.gauge.peak()

    def timed(self, trainer, batches, warmup, steps):
        """(seconds of each timed step, the largest activations, the largest step peak)."""
        for i in range(warmup):
            self.step(trainer, batches[i % len(batches)])
        self.gauge.synchronize()
        seconds, activations, peaks = [], [], []
        for i in range(steps):
            started = time.perf_counter()
            measured, peak = self.step(trainer, batches[i % len(batches)])
            self.gauge.synchronize()
            seconds.append(time.perf_counter() - started)
            activations.append(measured or 0)
            peaks.append(peak or 0)
        return seconds, max(activations) or None, max(peaks) or None

    def done(self, trainer, status="finished"):
        """Close `trainer`; the caller then drops its references and calls free()."""
        try:
            close_trainer(trainer) if status == "finished" else trainer.close(status)
        except FAILURES as error:  # a step that failed midway: its agreement or reducer is in pieces
            print(f"closing the trainer after a failure: {failure_text(error)}", file=sys.stderr)

    def free(self):
        """After a Trainer's last reference is gone: its memory back, compiled graphs forgotten."""
        self.torch._dynamo.reset()  # the next mode compiles its own graphs
        self.gauge.free()

    def close(self):
        from ddp_utils.distributed.process_group import cleanup_distributed

        cleanup_distributed()
        shutil.rmtree(self.work, ignore_errors=True)  # the Trainers' output folders (no checkpoints)


# --- the doctor's plan, on the CPU beside the GPU's work --------------------------------------


def doctor_key(args, mode):
    settings = {**{name: getattr(args, name) for name in GPT}, "amp": args.amp, "mode": mode, "data": args.data_dir}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def doctor_part(args):
    """The doctor's memory plan of one mode (--mode), as JSON in --out."""
    sys.path.insert(0, os.getcwd())
    from ddp_utils.configuration import parse_config
    from ddp_utils.doctor.memory import memory_plan
    from ddp_utils.doctor.run import build
    from task import TASK

    started = time.perf_counter()
    sizes = {name: getattr(args, name) for name in GPT}
    cfg = parse_config(TASK.config, project_flags(sizes, args.data_dir, amp=args.amp, device="cpu",
                                                  activation_checkpointing=args.mode))  # fmt: skip
    model, small, _ = build(TASK, cfg)  # as doctor.py builds them: the model and its 4 samples
    plans = memory_plan(model, small, TASK.loss_fn, cfg, 1, 1)[0]
    result = {"mode": args.mode, "ddp": plans["ddp"], "seconds": time.perf_counter() - started}
    Path(args.out).write_text(json.dumps(result))


class Doctor:
    """The doctor's plans, from --doctor_cache or computed by one CPU process per mode meanwhile."""

    def __init__(self, args, modes):
        self.args, self.files, self.processes = args, {}, {}
        cache = Path(args.doctor_cache)
        cache.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 4) * 3 // 4 // len(modes))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}
        for mode in modes:
            self.files[mode] = cache / f"{mode}-{doctor_key(args, mode)}.json"
            if self.files[mode].exists():
                continue
            command = [sys.executable, str(Path(__file__).resolve()), "--part", "doctor", "--mode", mode,
                       "--out", str(self.files[mode]), "--data_dir", args.data_dir, "--amp", args.amp]  # fmt: skip
            command += [item for name in GPT for item in (f"--{name}", str(getattr(args, name)))]
            log = open(cache / f"{mode}.log", "w")  # noqa: SIM115 (open while the process runs)
            self.processes[mode] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def plans(self, seconds):
        """{mode: the plan's ddp bytes, or why there is none}, waiting at most `seconds`."""
        deadline = time.monotonic() + max(0.0, seconds)
        results = {}
        for mode, file in self.files.items():
            process = self.processes.get(mode)
            if process is not None:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()  # ours: started above
                    process.wait()
                    results[mode] = "the doctor's plan did not finish in time (CPU)"
                    continue
            if file.exists():
                results[mode] = json.loads(file.read_text())["ddp"]
            else:
                log = Path(self.args.doctor_cache) / f"{mode}.log"
                tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
                results[mode] = f"the doctor's plan failed: {' '.join(tail)[:200]}"
        return results


def versus_doctor(measured, plan):
    """The doctor's activations against `measured` bytes: (a text, the doctor's bytes or "-", the
    ratio's text or why there is none, with whether it is within the target's 20%)."""
    if isinstance(plan, str):
        return plan, "-", plan
    predicted = plan["activations"]
    if not measured:
        return f"the doctor's {gib(predicted)} (nothing measured: no GPU)", gib(predicted), "no GPU"
    ratio = predicted / measured
    within = f"{ratio:.2f}x, target within 20%: {met(abs(ratio - 1) <= 0.2)}"
    return f"the doctor's {gib(predicted)}: {within}", gib(predicted), within


def markdown(header, lines):
    """A Markdown table: `header`'s names, then `lines` (lists of cells)."""
    rule = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in [header, rule, *lines])


# --- the parts ---------------------------------------------------------------------------------


def steady_part(args, modes, doctor):
    run = Run(args)
    results, table = {}, []
    for mode in modes:
        name = f"{mode}: {run.job} compile={args.compile}"
        if run.left() < args.mode_seconds:
            row(name, f"NOT RUN: {run.left():.0f} s left, a mode needs about {args.mode_seconds} s")
            continue
        started, trainer, batches, failed = time.monotonic(), None, None, None
        try:
            trainer = run.trainer(f"steady_{mode}", activation_checkpointing=mode, compile=args.compile)
            batches = run.batches(trainer, args.batch_size, 4)
            seconds, activations, peak = run.timed(trainer, batches, args.warmup, args.steps)
        except FAILURES as error:
            failed = failure_text(error)
        if trainer is not None:
            run.done(trainer, "crashed" if failed else "finished")
        trainer = batches = None
        run.free()
        if failed:
            row(name, failed)
            continue
        step_s = statistics.median(seconds)
        results[mode] = {"step_s": step_s, "tokens_per_s": args.batch_size * run.tokens / step_s,
                         "activations": activations, "peak": peak, "seconds": time.monotonic() - started}  # fmt: skip
        print(f"{mode}: {results[mode]}", file=sys.stderr, flush=True)
    plans = doctor.plans(run.left() - 5)
    for mode, r in results.items():
        text, predicted, ratio = versus_doctor(r["activations"], plans[mode])
        row(
            f"{mode}: {run.job} compile={args.compile}",
            f"ok ({r['tokens_per_s']:.0f} tokens/s, peak {gib(r['peak'])}, activations {gib(r['activations'])}; "
            f"{text}; {r['seconds']:.0f} s for the mode, its compile included)",
        )
        tokens = f"{r['tokens_per_s']:.0f}"
        table.append([mode, tokens, f"{r['step_s']:.3f}", gib(r["peak"]), gib(r["activations"]), predicted, ratio])
    if "none" in results and "full" in results:
        none, full = results["none"], results["full"]
        time_ratio = full["step_s"] / none["step_s"]
        memory = "not measured (no GPU)"
        if none["activations"]:
            ratio = full["activations"] / none["activations"]
            memory = f"{ratio:.2f}x, target at most 0.33x: {met(ratio <= 1 / 3)}"
        row(
            f"full against none, compile={args.compile}",
            f"ok (activations {memory}; step time {time_ratio:.2f}x, target at most 1.4x: {met(time_ratio <= 1.4)})",
        )
    run.close()
    header = ["mode", "tokens/s", "s a step (median)", "peak (max_memory_allocated)", "activations measured",
              "the doctor's activations", "the doctor / measured"]  # fmt: skip
    print(f"\n{run.job}, compile={args.compile}, ddp, one GPU:\n\n{markdown(header, table)}", flush=True)


def search_part(args, modes, doctor, reserve):
    """The largest micro-batch per mode that trains (eager), with `reserve` seconds kept for later parts."""
    run = Run(args)
    table, at_job = [], {}
    for index, mode in enumerate(modes):
        share = min(args.search_seconds, (run.left() - reserve) / (len(modes) - index))
        if share < 10:
            row(f"{mode}: the largest micro-batch", f"NOT RUN: {run.left():.0f} s left")
            continue
        until = time.monotonic() + share
        trainer, probes, peak_at = None, 0, {}
        size, low, high = args.batch_size, None, None
        try:
            while size and time.monotonic() < until:
                if trainer is None:
                    trainer = run.trainer(f"search_{mode}", activation_checkpointing=mode, compile="false")
                batch = run.batches(trainer, size, 1)[0]
                probes += 1
                ran_out = None
                try:
                    results = [run.step(trainer, batch) for _ in range(2)]
                except (run.torch.OutOfMemoryError, out_of_memory_error()) as error:
                    ran_out = failure_text(error)
                batch = None  # after the except block: its traceback no longer holds the step's tensors
                if ran_out:
                    print(f"{mode}: {size} samples: {ran_out[:200]}", file=sys.stderr, flush=True)
                    run.done(trainer, "crashed")
                    trainer, high = None, size
                    run.free()
                else:
                    low, peak_at[size] = size, results[-1][1]
                    if size == args.batch_size:
                        at_job[mode] = results[-1][0]
                    print(f"{mode}: {size} samples fit, peak {gib(results[-1][1])}", file=sys.stderr, flush=True)
                size = next_size(low, high, args.max_batch)
        except FAILURES as error:
            failed = failure_text(error)
        else:
            failed = None
        if trainer is not None:
            run.done(trainer, "crashed" if failed else "finished")
        trainer = batch = None
        run.free()
        if failed:
            row(f"{mode}: the largest micro-batch", failed)
            continue
        if low is None:
            found = f"none fits: {args.batch_size} samples ran out of memory"
        else:
            bracket = f"{high} ran out of memory" if high else f"none tried ran out (--max_batch {args.max_batch})"
            unfinished = "" if size is None else f"; the search stopped at its time share, next {size}"
            found = f"{low} samples ({low * run.tokens} tokens), peak {gib(peak_at[low])}; {bracket}{unfinished}"
        row(f"{mode}: the largest micro-batch (eager bf16)", f"ok ({found}; {probes} sizes tried)")
        table.append((mode, low, high, peak_at.get(low), probes))
    plans = doctor.plans(run.left() - reserve - 5)
    lines = []
    for mode, low, high, peak, probes in table:
        text, predicted, ratio = versus_doctor(at_job.get(mode), plans[mode])
        if mode in at_job:
            row(
                f"{mode}: activations at {args.batch_size} samples, eager", f"ok (measured {gib(at_job[mode])}; {text})"
            )
        lines.append([mode, low or "-", high or "-", gib(peak), probes, gib(at_job.get(mode)), predicted, ratio])
    run.close()
    header = ["mode", "largest micro-batch that fits", "the first that did not", "its peak", "sizes tried",
              f"activations at {args.batch_size}", "the doctor's", "the doctor / measured"]  # fmt: skip
    print(f"\n{run.job}, no compile, ddp, one GPU:\n\n{markdown(header, lines)}", flush=True)


def next_size(low, high, most):
    """The next micro-batch to try: double until one fails, then halve the gap to 1/8 of the one that fits."""
    if low is None:
        return None  # the job's own batch does not fit
    if high is None:
        return min(2 * low, most) if low < most else None
    gap = max(1, low // 8)
    if high - low <= gap:
        return None
    middle = (low + high) // 2
    step = 8 if low >= 64 else 1
    middle = max(low + 1, middle // step * step)
    return middle if middle < high else None


def out_of_memory_error():
    from ddp_utils.errors import OutOfMemory

    return OutOfMemory


def offload_part(args):
    sys.path.insert(0, os.getcwd())
    from config import Config

    if "cpu_offload" not in Config.__dataclass_fields__:
        row("--cpu_offload under fsdp", "this bake has no --cpu_offload knob (config.py): make a bake that has it")
        return
    run = Run(args, host_collectives=True)
    results, table = {}, []
    for name, offload in (("fsdp", False), ("fsdp --cpu_offload", True)):
        if run.left() < 20:
            row(f"{name}: eager bf16 steps", f"NOT RUN: {run.left():.0f} s left")
            continue
        trainer, batches, failed = None, None, None
        try:
            trainer = run.trainer(name.replace(" --", "_"), strategy="fsdp", cpu_offload=str(offload).lower(),
                                  activation_checkpointing=args.offload_mode, compile="false")  # fmt: skip
            batches = run.batches(trainer, args.batch_size, 4)
            seconds, _, peak = run.timed(trainer, batches, args.offload_warmup, args.offload_steps)
        except FAILURES as error:
            failed = failure_text(error)
        if trainer is not None:
            run.done(trainer, "crashed" if failed else "finished")
        trainer = batches = None
        run.free()
        if failed:
            row(f"{name}: eager bf16 steps", failed)
            continue
        step_s = statistics.median(seconds)
        results[name] = {"step_s": step_s, "peak": peak}
        ratio = f"{step_s / results['fsdp']['step_s']:.2f}x fsdp's step" if offload and "fsdp" in results else "-"
        row(
            f"{name}: eager bf16 steps",
            f"ok ({step_s:.3f} s a step, median of {len(seconds)} ({min(seconds):.3f}-{max(seconds):.3f}), "
            f"{args.batch_size * run.tokens / step_s:.0f} tokens/s, peak {gib(peak)}"
            + (f"; {ratio})" if offload else ")"),
        )
        table.append([name, f"{step_s:.3f}", f"{args.batch_size * run.tokens / step_s:.0f}", gib(peak), ratio])
    run.close()
    header = ["one GPU", "s a step (median)", "tokens/s", "peak (max_memory_allocated)", "against fsdp"]
    job = f"{run.job}, --activation_checkpointing {args.offload_mode}, no compile"
    print(f"\n{job}:\n\n{markdown(header, table)}", flush=True)


# --- here, with --tiny: bake, then every part in the project, on the CPU ----------------------


def dry_run(args):
    from run import bake

    work = Path(tempfile.mkdtemp(prefix="ac-gpu-dry-run-"))
    project, data_flags = bake("language", work / "bake")
    common = ["--tiny", "--data_dir", data_flags[1], "--doctor_cache", str(work / "doctor"), "--device", args.device]
    common += ["--compile", args.compile]
    for part in ("offload,search", "steady"):
        print(f"\n## --part {part} (in {project})", flush=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--part", part, *common]
        subprocess.run(command, cwd=project, check=True)
    shutil.rmtree(work)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="", help="steady, search, offload (comma-separated), in the project's folder")
    parser.add_argument("--data_dir", help="the language task's token files (prepare_data.py's)")
    for name, value in GPT.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"the GPT's --{name} (default {value})")
    parser.add_argument("--modes", default=",".join(MODES), help="--activation_checkpointing modes, in order")
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--device", default="auto", help="train.py's --device (--tiny: cpu)")
    parser.add_argument("--compile", default="true", help="steady: train.py's --compile")
    parser.add_argument(
        "--warmup", type=int, default=3, help="steady: steps before the timed ones (the first compiles)"
    )
    parser.add_argument("--steps", type=int, default=10, help="steady: timed steps")
    parser.add_argument("--mode_seconds", type=int, default=60, help="steady: a mode starts only with this much left")
    parser.add_argument("--max_batch", type=int, default=4096, help="search: the largest micro-batch tried")
    parser.add_argument("--search_seconds", type=float, default=75, help="search: at most this long a mode")
    parser.add_argument("--offload_mode", default="none", help="offload: its --activation_checkpointing")
    parser.add_argument("--offload_warmup", type=int, default=2)
    parser.add_argument("--offload_steps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=330, help="the part's time: no new work after it")
    parser.add_argument(
        "--doctor_cache", default=os.path.join(tempfile.gettempdir(), "activation_checkpointing_doctor")
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (outside a project: bake one first)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # --part doctor: the mode
    parser.add_argument("--out", help=argparse.SUPPRESS)  # --part doctor: the JSON file
    args = parser.parse_args()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.device = "cpu" if args.device == "auto" else args.device
        args.warmup, args.steps, args.offload_steps, args.max_batch = 2, 3, 3, 64
        args.mode_seconds = min(args.mode_seconds, 10)
        if not Path("task.py").exists():
            return dry_run(args)
    if args.part == "doctor":
        return doctor_part(args)
    parts = [part for part in args.part.split(",") if part]
    if not parts or not set(parts) <= {"steady", "search", "offload"} or not args.data_dir:
        parser.error("give --part steady|search|offload (comma-separated) and --data_dir, in the project's folder")
    modes = [mode for mode in args.modes.split(",") if mode]
    started, doctor = time.monotonic(), None
    for index, part in enumerate(parts):
        args.seconds -= time.monotonic() - started
        started = time.monotonic()
        if part == "offload":
            offload_part(
                args
            )  # first in check 23: before the doctor's CPU processes start (its optimizer steps on the CPU)
            continue
        doctor = doctor or Doctor(args, modes)  # on the CPU, beside the GPU's work
        if part == "steady":
            steady_part(args, modes, doctor)
        else:
            reserve = 60 if "offload" in parts[index:] else 0  # the offload's time, after it
            search_part(args, modes, doctor, min(reserve, args.seconds / 3))


if __name__ == "__main__":
    main()
