"""What a run reports, on global rank 0 only: metrics.jsonl, the trackers, a progress bar, MFU,
the step timing of each metrics line (`Period`), the loss lines in between (`LossLog`) and,
without a progress bar, a line at least every --progress_every_seconds (`ProgressLine`).

Nothing here calls a collective: the Trainer reduces the numbers first, then hands them over.
"""

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.files import fenced, write_atomically
from ..core.logs import log, rank_zero_only, report
from ..distributed.collectives import HostCopy
from ..errors import FolderLost
from .progress import ProgressLine
from .trackers import open_trackers


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
    first_step: int = 0  # the optimizer step that opened the window

    def open_window(self, samples, step=0):
        # Throughput counts from the end of the period's first step: compile warm-up, worker
        # start-up and the first batches' latency stay out.
        if self.window is None:
            self.window = (time.perf_counter(), samples, self.checkpoint_s)
            self.first_step = step

    def seconds_per_step(self, step, now):
        """Time per optimizer step in this period so far, counted as samples_per_s counts
        (from the end of its first step, checkpoints left out); None before its first step."""
        if self.window is None:
            return None
        opened, _, checkpoint_then = self.window
        steps = step - self.first_step
        if steps <= 0:  # the period's first step alone: the whole period
            opened, checkpoint_then, steps = self.started, 0.0, 1
        seconds = now - opened - (self.checkpoint_s - checkpoint_then)
        return seconds / steps if seconds > 0 else None

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
            "checkpoint_s": self.checkpoint_s,  # saving checkpoints: what the steps waited for (async: the copy)
            "cpu_s": cpu_seconds,  # rank 0's CPU time while training: host overhead shows here
            "peak_memory_mb": peak_memory_mb(device),  # rank 0's, since the last line
        }


class LossLog:
    """Every --log_every_steps optimizer steps, a line with the step's loss, learning rate and
    gradient norm: copied off the device when the step ends, printed a step later, when the
    copy is done, so the host never waits for the device."""

    def __init__(self, every, reporter, progress_line=None):
        self.every, self.reporter, self.progress_line = every, reporter, progress_line
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
        if self.progress_line is not None:  # a line: no progress line is due for a while
            self.progress_line.printed()
        self.reporter.train_loss(step, values, samples_per_s)
        self.pending = None


class Meter:
    """What the log lines and metrics lines report, measured on every rank and written by rank 0
    (Reporter): the period since the last metrics line (Period), each log step's loss line
    (LossLog), tokens/s and MFU (Throughput), and rank 0's progress line without a bar
    (ProgressLine). The trainer computes the agreed numbers (losses, evaluation) with
    collectives; nothing here calls one."""

    def __init__(self, cfg, ctx, reporter, throughput):
        self.device, self.reporter, self.throughput = ctx.device, reporter, throughput
        # Rank 0 without a progress bar only: the bar shows all of it already.
        every = cfg.progress_every_seconds if ctx.is_main and not reporter.progress else 0.0
        self.progress_line = ProgressLine(every)
        self.loss_log = LossLog(cfg.log_every_steps, reporter, self.progress_line)
        self.period = Period(time.perf_counter(), time.process_time(), 0)  # restarted when training starts

    def start_period(self, samples):
        """Measure what the next metrics line reports from now (`samples` trained so far): time,
        and the peak of memory. Training starts, or a metrics line was just written: the next
        progress line is due --progress_every_seconds from now."""
        reset_peak_memory(self.device)
        self.period = Period(time.perf_counter(), time.process_time(), samples)
        self.progress_line.printed()

    def waited_for_data(self, seconds):
        self.period.data_wait_s += seconds

    def saved_checkpoint(self, seconds):
        self.period.checkpoint_s += seconds  # left out of throughput

    def log_due(self, step):
        """Whether optimizer step `step` gets a loss line (--log_every_steps)."""
        return self.loss_log.due(step)

    def step_done(self, step, samples, loss, norm, scale, lr):
        """After optimizer step `step`, `samples` trained: throughput counts from the end of the
        period's first step; the loss line is kept back a step (LossLog); rank 0 prints a
        progress line if none was printed for --progress_every_seconds (ProgressLine)."""
        self.period.open_window(samples, step)
        self.loss_log.record(step, loss, norm, scale, lr, self.period.samples_per_s(samples, time.perf_counter()))
        self.progress_line.step_done(step, self.reporter.planned_steps, loss, self.period)

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
        next period starts. Returns rank 0's line when the output folder is no longer this
        run's (nothing written), for the trainer to stop every rank with."""
        metrics = {**metrics, **self.throughput.metrics(metrics["samples_per_s"])}
        lost = self.reporter.epoch_metrics(metrics)
        if lost:
            return lost
        report("%s", format_metrics(metrics))
        self.start_period(samples)
        return None


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
        self.max_steps = cfg.max_steps
        self.planned_steps = 0  # optimizer steps the run trains in all, once training starts (rank 0)

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
        """Append the metrics line; returns the line that stops the run when the output folder
        is another run's now (files.fenced), or None."""
        try:
            fenced()
        except FolderLost as lost:
            return str(lost)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        numbers = {key: value for key, value in metrics.items() if isinstance(value, (int, float)) and key != "step"}
        self._track(numbers, metrics["step"])
        return None

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
        """As training starts from optimizer step `step` (0: afresh, a run killed before its first
        checkpoint started again), drop the lines logged after it: they are about to be redone.
        Written whole (a crash leaves the old file or the new one) and fenced; returns the line
        that stops the run when the folder is another run's now, or None."""
        if not self.metrics_path.exists():
            return None
        kept = []
        for line in self.metrics_path.read_text().splitlines(keepends=True):
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError):  # a line cut short by a crash: drop it
                pass
        try:
            write_atomically(self.metrics_path, lambda f: f.write("".join(kept)), "w")
        except FolderLost as lost:
            return str(lost)
        return None

    @rank_zero_only
    def start_epoch(self, epoch, epochs, steps, done):
        """Epoch `epoch` of `epochs` starts, `done` of its `steps` optimizer steps done already."""
        self.planned_steps = self.max_steps or epochs * steps  # max_steps, when set, ends the run
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
