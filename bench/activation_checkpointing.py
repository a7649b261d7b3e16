"""What --activation_checkpointing saves and costs on the CPU: the language task's example GPT,
trained one step at a time by the generated project's own Trainer (ddp_utils/train/trainer.py,
a group of one gloo process, amp none: float32), once per mode (none, full, every_other, ops).

    .venv/bin/python bench/activation_checkpointing.py           # GPT 8 x 128, 512-token windows, batch 4
    .venv/bin/python bench/activation_checkpointing.py --tiny    # the script's path, not its numbers
    bash dev/bench.sh --activation-checkpointing                 # the same, after dev/setup.sh

Each mode gets its own Trainer, built from the same config and seed (the same initial weights),
all four in one process, fed the same batches.

- Activation memory: a training step's forward, loss and backward (Trainer.train_step) run under
  the doctor's LiveBytes dispatch mode (ddp_utils/doctor/memory.py), which counts the bytes of
  every tensor storage made under it from its making until it is freed. Reported: the peak of
  those bytes over the step (the step's activations at their highest: what the forward keeps,
  the recompute of a checkpointed block in the backward, the activations' gradients; the
  parameters' gradients are views of DDP's buckets, made before, so not counted), what is held
  when the backward starts (what the forward saved for it, and the loss), and the doctor's
  plan for the mode at this batch (mode_activations, as doctor.py measures it: the peak of a
  forward and the loss under none; with a mode on, through the backward, where the recompute
  peaks). Exact byte counts of tensors, not the process's memory: on a CPU no
  allocator keeps the statistics CUDA's does, and the resident size moves with malloc's caching.
- Step time: Trainer.train_step then Trainer.optimizer_step (clipping, AdamW, the step
  agreement), timed one step at a time; in each round every mode takes one step, in an order
  that turns by one each round so that drift in the machine's load hits all modes alike. The
  first --warmup rounds are left out; reported: each mode's median and range, and the median of
  the rounds' ratios to none.

The issue's targets (issue 63): full at most 1/3 of none's activation memory at no more than
1.4x its step time; every_other and ops in between. A benchmark, not a test: it asserts nothing.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "full", "every_other", "ops")
SIZES = {"n_layer": 8, "n_head": 4, "n_embd": 128, "block_size": 512, "batch_size": 4}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 2}
MIB = 2**20


# --- in the baked project's folder (imports its task and machinery) ---------------------------


def project_flags(sizes, data_dir, **settings):
    """train.py's flags for one run: the GPT's sizes, its data, and `settings` (name: value)."""
    flags = {**sizes, "data_dir": data_dir, "resume": "none", "progress_bar": "false", "log_every_steps": 0,
             "max_steps": 100000, "val_samples": 8, **settings}  # fmt: skip
    return [str(item) for name, value in flags.items() for item in (f"--{name}", value)]


def batches_of(dataset, collate, samples, count, start=0):
    """`count` batches of `samples` training samples each, taken in order from `start`."""
    n = len(dataset)
    return [collate([dataset[(start + i * samples + j) % n] for j in range(samples)]) for i in range(count)]


def build_trainer(task, argv, ctx, datasets):
    """The project's Trainer for train.py's flags `argv`, in this process's group `ctx`."""
    from ddp_utils.configuration import parse_config
    from ddp_utils.train.trainer import Trainer

    cfg = parse_config(task.config, argv)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, ctx, task, datasets)


def close_trainer(trainer):
    trainer.read_agreement()  # the last step's
    trainer.close("finished")


def measure(args):
    """Every mode's activation bytes and step times, as JSON on stdout."""
    sys.path.insert(0, os.getcwd())
    import torch
    from ddp_utils.configuration import parse_config
    from ddp_utils.distributed.process_group import cleanup_distributed, setup_distributed
    from ddp_utils.doctor.memory import LiveBytes, mode_activations
    from ddp_utils.doctor.run import built
    from ddp_utils.train.inputs import check_inputs
    from task import TASK

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    sizes = {name: getattr(args, name) for name in SIZES}
    argv = project_flags(sizes, args.data_dir, amp="none", device="cpu", output_dir=work / "config")
    cfg = parse_config(TASK.config, argv)
    ctx = setup_distributed(cfg.timeout_seconds, device="cpu")
    datasets = check_inputs(TASK, cfg, ctx)[0]

    tracking = {}  # the LiveBytes of the step being measured, and what it held when the loss was made

    def loss_fn(output, batch):
        loss = TASK.loss_fn(output, batch)
        if "tracker" in tracking:
            tracking["held"] = tracking["tracker"].live
        return loss

    task = TASK.replace(loss_fn=loss_fn)
    trainers = {}
    for mode in MODES:
        mode_argv = project_flags(sizes, args.data_dir, amp="none", device="cpu", output_dir=work / mode,
                                  activation_checkpointing=mode)  # fmt: skip
        trainers[mode] = build_trainer(task, mode_argv, ctx, datasets)
    collate = trainers["none"].train_loader.collate_fn
    batches = batches_of(datasets[0], collate, args.batch_size, 4)

    results = {mode: {"seconds": [], "cpu_seconds": []} for mode in MODES}
    for round_ in range(args.warmup + args.repeats):
        turn = round_ % len(MODES)
        for mode in MODES[turn:] + MODES[:turn]:
            trainer, batch = trainers[mode], batches[round_ % len(batches)]
            gc.collect()
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step(batch, sync=True)
            trainer.optimizer_step()
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
            if round_ >= args.warmup:
                results[mode]["seconds"].append(seconds)
                results[mode]["cpu_seconds"].append(cpu_seconds)
        done = ", ".join(f"{m} {results[m]['seconds'][-1]:.2f} s" for m in MODES if results[m]["seconds"])
        print(f"round {round_ + 1}: {done or 'warm-up'}", file=sys.stderr, flush=True)

    # Memory after the timed steps: DDP rebuilds its buckets in its second step (new storages
    # that would count), and the optimizer's state exists by now.
    plain = built(TASK, cfg)  # the doctor's model: as training builds it, not wrapped
    for mode, trainer in trainers.items():
        gc.collect()
        with LiveBytes() as tracker:
            tracking["tracker"] = tracker
            trainer.train_step(batches[0], sync=True)
            del tracking["tracker"]
        trainer.optimizer_step()
        results[mode]["step_peak"] = max(tracker.trace)
        results[mode]["held"] = tracking.pop("held")
        results[mode]["doctor"] = mode_activations(plain, batches[0], TASK.loss_fn, cfg, mode, backward=True)
        print(f"{mode}: step peak {results[mode]['step_peak'] / MIB:.1f} MiB", file=sys.stderr, flush=True)
    for trainer in trainers.values():
        close_trainer(trainer)
    cleanup_distributed()
    results["threads"] = torch.get_num_threads()
    results["torch"] = torch.__version__
    print(json.dumps(results))


# --- here: bake, measure in the project, print ------------------------------------------------


def targets(results):
    """The issue's targets, each with whether it is met (the step time's by wall clock and by CPU seconds)."""
    memory = {m: results[m]["step_peak"] / results["none"]["step_peak"] for m in MODES}
    wall, cpu = ({m: results[m][key] for m in MODES} for key in ("ratio", "cpu_ratio"))
    met = {True: "met", False: "NOT met"}
    lines = [
        f"full's activation memory {memory['full']:.2f}x none's (target at most 0.33x): {met[memory['full'] <= 1 / 3]}",
        (
            f"full's step time {wall['full']:.2f}x none's by the clock, {cpu['full']:.2f}x in CPU seconds (target "
            f"at most 1.4x): {met[wall['full'] <= 1.4]} by the clock, {met[cpu['full'] <= 1.4]} in CPU seconds"
        ),
    ]
    for mode in ("every_other", "ops"):
        in_memory = memory["full"] <= memory[mode] <= 1.0
        in_time = [1.0 <= ratio[mode] <= ratio["full"] for ratio in (wall, cpu)]
        lines.append(
            f"{mode} between none and full: activation memory {memory[mode]:.2f}x ({met[in_memory]}), step time "
            f"{wall[mode]:.2f}x by the clock ({met[in_time[0]]}), {cpu[mode]:.2f}x in CPU seconds ({met[in_time[1]]})"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=value, help=f"the GPT's --{name} (default {value})")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (each mode one step a round)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out before them")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (1: CPU seconds are the work)")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT, 2 rounds: the script's path")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # in the project's folder
    parser.add_argument("--data_dir", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.repeats, args.warmup = 2, 1

    from run import bake, cpu_model

    started = datetime.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="activation-checkpointing-bench-"))
    project, data_flags = bake("language", work / "bake")
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", "--data_dir", data_flags[1],
               "--work", str(work / "runs"), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--threads", str(args.threads)]  # fmt: skip
    command += [item for name in SIZES for item in (f"--{name}", str(getattr(args, name)))]
    load_before = os.getloadavg()[0]
    measured = subprocess.run(command, cwd=project, check=True, stdout=subprocess.PIPE, text=True)
    load_after = os.getloadavg()[0]
    results = json.loads(measured.stdout.strip().splitlines()[-1])
    shutil.rmtree(work)
    for key, ratio in (("seconds", "ratio"), ("cpu_seconds", "cpu_ratio")):
        for mode in MODES:  # the median of the rounds' ratios to none
            pairs = zip(results[mode][key], results["none"][key])
            results[mode][ratio] = statistics.median(t / n for t, n in pairs)

    tokens = args.batch_size * args.block_size
    threads = f"{results['threads']} thread" + ("s" if results["threads"] > 1 else "")
    lines = [
        (
            f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), {cpu_model()}; Python "
            f"{platform.python_version()}, torch {results['torch']} ({threads}); "
            f"{started:%Y-%m-%d %H:%M}; load average (1 min) {load_before:.1f} before, {load_after:.1f} after"
        ),
        f"- Command: python bench/activation_checkpointing.py {shlex.join(sys.argv[1:])}".rstrip(),
        (
            f"- Job: the example GPT, {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads, byte tokens "
            f"(vocabulary 256), {args.block_size}-token windows, batch {args.batch_size} ({tokens} tokens a step), "
            "float32 (--amp none), the project's Trainer in a group of one gloo process (DDP); activation memory: "
            "the peak over a step's forward, loss and backward of the bytes of the tensors made in it (the doctor's "
            "LiveBytes), with what is held when the backward starts and the doctor's plan (mode_activations: a "
            f"forward and the loss under none, through the backward with a mode on); step time: forward, backward and optimizer step, {args.repeats} interleaved rounds after "
            f"{args.warmup} of warm-up, by the clock and in the process's CPU seconds; the ratios to none are the "
            "medians of the rounds' ratios"
        ),
        "",
        (
            "| mode | activation memory, step peak (MiB) | x none | held for the backward (MiB) | doctor's plan (MiB) "
            "| step time, median (min-max) (s) | x none | CPU s a step, median | x none |"
        ),
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        r, times = results[mode], results[mode]["seconds"]
        lines.append(
            f"| {mode} | {r['step_peak'] / MIB:.1f} | {r['step_peak'] / results['none']['step_peak']:.2f} | "
            f"{r['held'] / MIB:.1f} | {r['doctor'] / MIB:.1f} | {statistics.median(times):.3f} "
            f"({min(times):.3f}-{max(times):.3f}) | {r['ratio']:.2f} | {statistics.median(r['cpu_seconds']):.3f} | "
            f"{r['cpu_ratio']:.2f} |"
        )
    lines += ["", *(f"- {line}" for line in targets(results))]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
