"""What a run reports, on global rank 0 only: metrics.jsonl, the trackers, a progress bar, MFU,
the step timing of each metrics line (`Period`) and the loss lines in between (`LossLog`).

Nothing here calls a collective: the Trainer reduces the numbers first, then hands them over.
"""

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from .contract import build_on_meta, model_inputs
from .dist import HostCopy
from .logs import log, rank_zero_only, report
from .trackers import open_trackers

# Dense peak TFLOPS of one GPU (tensor cores without sparsity: half the sheets' sparse figures),
# by the exact name torch.cuda.get_device_name() gives: bf16/fp16 tensor cores, TF32 tensor
# cores, and plain FP32 (amp none with --tf32 false). Each from NVIDIA's data sheet for that
# part. A name that is not here (a GPU without a data sheet, such as AWS's A10G, or a new one)
# gets no MFU: set --peak_tflops.
_H100_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}  # H100 data sheet, SXM
_H100_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}  # H100 data sheet, NVL
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}  # A100 data sheet, SXM and PCIe alike
_V100_SXM2 = {"bf16": 0.0, "fp16": 125.0, "tf32": 0.0, "fp32": 15.7}  # V100 data sheet: no bf16, no TF32
_V100_PCIE = {"bf16": 0.0, "fp16": 112.0, "tf32": 0.0, "fp32": 14.0}
PEAK_TFLOPS = {
    "NVIDIA B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},  # HGX B200 data sheet, per GPU
    "NVIDIA H200": _H100_SXM,  # H200 data sheet, SXM: the H100 SXM's tensor cores
    "NVIDIA H200 NVL": _H100_NVL,  # H200 data sheet, NVL
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},  # H100 data sheet, PCIe
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},  # L40S data sheet
    "NVIDIA L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},  # L40 data sheet
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},  # L4 data sheet
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},  # A10 data sheet
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
    "Tesla T4": {"bf16": 0.0, "fp16": 65.0, "tf32": 0.0, "fp32": 8.1},  # T4 data sheet
}


def peak_tflops(device_name, amp, tf32, override=0.0):
    """Peak TFLOPS of one device for this precision; 0.0 when unknown (MFU is then not reported).

    amp none runs matmuls in TF32 when --tf32 is on and the GPU has it, else in plain FP32.
    """
    if override > 0:
        return override
    peaks = PEAK_TFLOPS.get(device_name.strip())
    if peaks is None:
        return 0.0
    if amp != "none":
        return peaks[amp]
    return peaks["tf32"] if tf32 and peaks["tf32"] else peaks["fp32"]


def flops_per_sample(cfg, task, batch):
    """Training FLOPs (forward and backward) per sample, counted by PyTorch's FlopCounterMode.

    The model is built on the meta device: no memory, no arithmetic, no random draws and no
    state touched, yet every matmul, convolution and attention call is counted as it runs
    (6 x parameters misses attention and convolutions, and counts embedding lookups).
    `batch` is a batch of one training sample; `task` the contract's (contract.load_task).
    A model that cannot be built on the meta device counts as 0 (no MFU is reported).
    """
    batch = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), batch)
    model = build_on_meta(task.build_model, cfg)
    if model is None:
        return 0
    # Evaluation mode: the model's own FLOPs, without activation checkpointing's recompute
    # (MFU counts model FLOPs, not hardware FLOPs) or dropout.
    model.eval()
    with FlopCounterMode(display=False) as counter:
        task.loss_fn(model(model_inputs(batch)), batch).backward()
    return counter.get_total_flops()


def mfu(flops_per_sample, samples_per_s, world_size, peak_tflops):
    """Model FLOPs utilisation: achieved model FLOPs per device over the device's peak."""
    if peak_tflops <= 0 or flops_per_sample <= 0:
        return None
    return flops_per_sample * samples_per_s / world_size / (peak_tflops * 1e12)


@dataclass(frozen=True)
class Throughput:
    """What turns samples/s into tokens/s and MFU for this model, precision and device."""

    flops_per_sample: float  # training FLOPs (flops_per_sample); 0 when not counted
    tokens_per_sample: int  # predictions per sample (model.py's tokens_per_sample)
    peak_tflops: float  # of one device; 0 when unknown
    world_size: int

    def metrics(self, samples_per_s):
        """tokens_per_s for sequences, mfu where the device's peak is known."""
        metrics = {}
        if self.tokens_per_sample > 1:  # sequences: each sample holds many predictions
            metrics["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        utilisation = mfu(self.flops_per_sample, samples_per_s, self.world_size, self.peak_tflops)
        if utilisation is not None:
            metrics["mfu"] = utilisation
        return metrics


def build_throughput(cfg, ctx, task, one_sample):
    """The run's Throughput: FLOPs counted on a batch of `one_sample` (meta device), the GPU's
    peak from its name (or --peak_tflops)."""
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
    return Throughput(
        flops_per_sample=flops_per_sample(cfg, task, one_sample),
        tokens_per_sample=task.tokens_per_sample(cfg),
        peak_tflops=peak_tflops(device_name, cfg.amp, cfg.tf32, cfg.peak_tflops),
        world_size=ctx.world_size,
    )


def peak_memory_mb(device):
    """Peak memory of this process since the last reset_peak_memory: allocated on the GPU, or
    resident (RSS high-water mark) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024  # KiB
    except (OSError, IndexError):  # not Linux: the peak since the process started
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory(device):
    """Start a new peak (each epoch reports its own)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the RSS high-water mark
    except OSError:
        pass


def format_metrics(metrics):
    parts = [f"{key} {value:.5g}" if isinstance(value, float) else f"{key} {value}" for key, value in metrics.items()]
    return " ".join(parts)


@dataclass
class Period:
    """Timing of the training since the last metrics line, which reports it."""

    started: float  # perf_counter()
    cpu_started: float  # process_time()
    samples_at_start: int
    data_wait_s: float = 0.0  # waiting for batches
    checkpoint_s: float = 0.0  # saving checkpoints (left out of throughput)
    window: tuple = None  # (time, samples trained, checkpoint_s) at the end of the period's first step

    def open_window(self, samples):
        # Throughput counts from the end of the period's first step: compile warm-up, worker
        # start-up and the first batches' latency stay out.
        if self.window is None:
            self.window = (time.perf_counter(), samples, self.checkpoint_s)

    def samples_per_s(self, samples, now):
        opened, samples_then, checkpoint_then = self.window or (self.started, self.samples_at_start, 0.0)
        if samples == samples_then:  # a single step: no window, the whole period
            opened, samples_then, checkpoint_then = self.started, self.samples_at_start, 0.0
        seconds = now - opened - (self.checkpoint_s - checkpoint_then)
        return (samples - samples_then) / seconds if seconds > 0 else 0.0

    def metrics(self, samples, device):
        """The period's timing and memory, for the metrics line, as it ends (before evaluation)."""
        ended, cpu_seconds = time.perf_counter(), time.process_time() - self.cpu_started
        train_seconds = ended - self.started - self.checkpoint_s
        return {
            "samples_per_s": self.samples_per_s(samples, ended),  # steady state: no first step, no checkpoints
            "data_wait_s": self.data_wait_s,  # rank 0's time waiting for batches
            "compute_s": train_seconds - self.data_wait_s,  # the rest of the training time
            "cpu_s": cpu_seconds,  # rank 0's CPU time while training: host overhead shows here
            "peak_memory_mb": peak_memory_mb(device),  # rank 0's, since the last line
        }


class LossLog:
    """Every --log_every_steps optimizer steps, a line with the step's loss, learning rate and
    gradient norm: copied off the device when the step ends, printed a step later, when the
    copy is done, so the host never waits for the device."""

    def __init__(self, every, reporter):
        self.every, self.reporter = every, reporter
        self.pending = None  # (step, HostCopy of loss and gradient norm, lr, loss scale, samples/s)

    def due(self, step):
        return self.every and step % self.every == 0

    def record(self, step, loss, norm, scale, lr, samples_per_s):
        """After optimizer step `step`: print the previous due line, keep this one if due."""
        self.reporter.step()
        self.flush()
        if self.due(step):
            # fp16's loss scale (a tensor on the device) in the same copy; else a stand-in.
            values = [loss.float(), norm.float(), loss.new_zeros((), dtype=torch.float32) if scale is None else scale]
            self.pending = (step, HostCopy(torch.stack(values)), lr, scale is not None, samples_per_s)

    def flush(self):
        """Print the line kept back, if any."""
        if self.pending is None:
            return
        step, copy, lr, fp16, samples_per_s = self.pending
        loss_value, norm, scale = copy.tolist()
        scale = scale if fp16 else None
        values = {"train_loss_step": loss_value, "lr": lr, "grad_norm": norm}
        if scale is not None:  # fp16: the loss scale that step used
            values["loss_scale"] = scale
        scale_text = "" if scale is None else f" loss_scale {scale:g}"
        report("step %d loss %.4f lr %.3g grad_norm %.3g%s", step, loss_value, lr, norm, scale_text)
        self.reporter.train_loss(step, values, samples_per_s)
        self.pending = None


class Meter:
    """What the log lines and metrics lines report, measured on every rank and written by rank 0
    (Reporter): the period since the last metrics line (Period), each log step's loss line
    (LossLog), tokens/s and MFU (Throughput). The trainer computes the agreed numbers (losses,
    evaluation) with collectives; nothing here calls one."""

    def __init__(self, cfg, ctx, reporter, throughput):
        self.device, self.reporter, self.throughput = ctx.device, reporter, throughput
        self.loss_log = LossLog(cfg.log_every_steps, reporter)
        self.period = Period(time.perf_counter(), time.process_time(), 0)  # restarted when training starts

    def start_period(self, samples):
        """Measure what the next metrics line reports from now (`samples` trained so far): time,
        and the peak of memory."""
        reset_peak_memory(self.device)
        self.period = Period(time.perf_counter(), time.process_time(), samples)

    def waited_for_data(self, seconds):
        self.period.data_wait_s += seconds

    def saved_checkpoint(self, seconds):
        self.period.checkpoint_s += seconds  # left out of throughput

    def log_due(self, step):
        """Whether optimizer step `step` gets a loss line (--log_every_steps)."""
        return self.loss_log.due(step)

    def step_done(self, step, samples, loss, norm, scale, lr):
        """After optimizer step `step`, `samples` trained: throughput counts from the end of the
        period's first step; the loss line is kept back a step (LossLog)."""
        self.period.open_window(samples)
        self.loss_log.record(step, loss, norm, scale, lr, self.period.samples_per_s(samples, time.perf_counter()))

    def end_epoch(self):
        """The last step's loss line, if it is due; the progress bar closes."""
        self.loss_log.flush()
        self.reporter.end_epoch()

    def end_period(self, samples):
        """The period's timing and memory, as it ends (an evaluation that follows is left out),
        after the last step's loss line."""
        self.loss_log.flush()
        return self.period.metrics(samples, self.device)

    def write_line(self, metrics, samples):
        """One metrics line (metrics.jsonl, the trackers, the log), with tokens/s and MFU; the
        next period starts."""
        metrics = {**metrics, **self.throughput.metrics(metrics["samples_per_s"])}
        self.reporter.epoch_metrics(metrics)
        report("%s", format_metrics(metrics))
        self.start_period(samples)


class Reporter:
    """Writes metrics.jsonl (always), the trackers' runs (--tracker: trackers.py) and a
    progress bar (on a TTY).

    Every method is a no-op on ranks other than 0.
    """

    def __init__(self, ctx, cfg, output_dir):
        self.is_main = ctx.is_main
        self.output_dir = output_dir
        self.metrics_path = output_dir / "metrics.jsonl"
        self.trackers = {}
        self.bar = None
        # A bar only for a person watching: not in CI logs, files or other ranks' output.
        self.progress = cfg.progress_bar and ctx.is_main and sys.stdout.isatty()

    @rank_zero_only
    def open_trackers(self, cfg, resumed_step):
        """Start (or, resuming, continue) the trackers' runs; returns an error, or None."""
        try:
            self.trackers = open_trackers(cfg, self.output_dir, resumed_step)
        except Exception as error:  # a tracker's own failure (login, server): one line, every rank stops
            return f"--tracker: could not start the runs: {type(error).__name__}: {error}"
        return None

    def _track(self, metrics, step):
        """Send numbers to every tracker. One that fails is dropped with a warning: only rank 0
        is here, so an exception would leave the other ranks waiting in the next collective."""
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(metrics, step)
            except Exception as error:
                log.warning("--tracker %s failed and is turned off for this run (metrics.jsonl has it all): %s: %s",
                            name, type(error).__name__, error)  # fmt: skip
                del self.trackers[name]

    @rank_zero_only
    def epoch_metrics(self, metrics):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        numbers = {key: value for key, value in metrics.items() if isinstance(value, (int, float)) and key != "step"}
        self._track(numbers, metrics["step"])

    @rank_zero_only
    def sample(self, step, text):
        """A sample of the model's output (--sample_every_steps): train.log and the trackers."""
        report("sample at step %d:\n%s", step, text)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log_text("sample", text, step)
            except Exception as error:
                log.warning("--tracker %s could not log a sample: %s: %s", name, type(error).__name__, error)

    @rank_zero_only
    def train_loss(self, step, values, samples_per_s):
        """One log step's numbers: train_loss_step, lr, grad_norm and, under fp16, loss_scale."""
        self._track(values, step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{values['train_loss_step']:.4f}", samples_per_s=f"{samples_per_s:.0f}",
                                 refresh=False)  # fmt: skip

    @rank_zero_only
    def truncate(self, step):
        """On resume, drop lines logged after the checkpoint: they are about to be redone."""
        if self.metrics_path.exists():
            kept = []
            for line in self.metrics_path.read_text().splitlines(keepends=True):
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError):  # a line cut short by a crash: drop it
                    pass
            self.metrics_path.write_text("".join(kept))

    @rank_zero_only
    def start_epoch(self, epoch, epochs, steps, done):
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch}/{epochs}", unit="step")

    @rank_zero_only
    def step(self):
        if self.bar is not None:
            self.bar.update(1)

    @rank_zero_only
    def end_epoch(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @rank_zero_only
    def close(self, status):
        """status: finished, preempted or failed (how the trackers mark the run), or crashed:
        then the trackers are not closed, as closing may wait on a server and nothing may
        delay the exit (W&B marks such a run crashed; an MLflow run stays RUNNING)."""
        self.end_epoch()
        trackers = {} if status == "crashed" else self.trackers
        for name, tracker in trackers.items():
            try:
                tracker.close(status)
            except Exception as error:
                log.warning("--tracker %s did not close cleanly: %s: %s", name, type(error).__name__, error)
        self.trackers = {}
