"""Rank 0's progress line: the step of the planned total, the time per step and the time left.

Without a progress bar (stdout not a terminal, or --progress_bar false) rank 0 is never silent
for longer than --progress_every_seconds while steps keep their pace. Rank 0's clock alone
decides; nothing any rank computes depends on it, and a failure here only turns the line off.
"""

import time

from ..core.logs import log, report


def progress_due(now, last_line, every, step_seconds=0.0):
    """Whether rank 0 owes a progress line at `now`, as a step ends: the next step, if it takes
    `step_seconds` like the ones before, would end `every` seconds (--progress_every_seconds,
    0 = never) or more after its last line (`last_line`: the start of training or of a metrics
    period, a loss line, or the last progress line). So no silence lasts longer than `every`
    while steps keep their pace. Times are rank 0's own clock (perf_counter): nothing any rank
    computes, and no collective, may depend on this."""
    return every > 0 and now + step_seconds - last_line >= every


def format_duration(seconds):
    """12.3s, 4m05s, 2h07m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_step_time(seconds):
    return f"{seconds * 1000:.1f} ms/step" if seconds < 1 else f"{seconds:.2f} s/step"


def progress_text(step, planned, loss, seconds_per_step):
    """The progress line: step of the planned total, time per step and time left (both from
    this metrics period's steps; evaluation and checkpoints not counted), the loss."""
    parts = [f"progress: step {step}/{planned} ({100 * step / planned:.0f}%)" if planned else f"progress: step {step}"]
    if seconds_per_step is not None:
        parts.append(format_step_time(seconds_per_step))
        if planned:
            parts.append(f"{format_duration(max(planned - step, 0) * seconds_per_step)} left")
    parts.append(f"loss {loss:.4f} (rank 0's last micro-batch)")
    return ", ".join(parts)


class ProgressLine:
    """Without a progress bar (stdout not a terminal, or --progress_bar false), rank 0 is never
    silent for long: at least every --progress_every_seconds a line with the step of the
    planned total, the time per step, the time left and its own last micro-batch loss. A loss
    line (--log_every_steps) or a metrics line counts as a line: none is added after one.

    Rank 0's clock alone decides, as a step ends (progress_due); the line reads only what
    rank 0 has (its loss, once a line) and calls no collective, so no rank computes anything
    differently for it. On other ranks, and with a bar, `every` is 0: never. A failure here
    turns the line off with a warning: it never stops training.
    """

    def __init__(self, every, clock=time.perf_counter):
        self.every, self.clock = every, clock
        self.last_line = clock()

    def printed(self):
        """Rank 0 printed a line just now (training or a metrics period started, a loss line)."""
        self.last_line = self.clock()

    def step_done(self, step, planned, loss, period):
        """After optimizer step `step` of `planned` (0: unknown); `loss` this process's last
        micro-batch loss (a tensor, read only when a line is due), `period` the Period."""
        if not self.every:
            return
        try:
            now = self.clock()
            seconds_per_step = period.seconds_per_step(step, now)
            if not progress_due(now, self.last_line, self.every, seconds_per_step or 0.0):
                return
            self.last_line = now
            report("%s", progress_text(step, planned, loss.float().item(), seconds_per_step))
        except Exception as error:  # only a log line: never a reason to stop training
            self.every = 0
            log.warning("--progress_every_seconds: the progress line failed and is turned off for this run: %s: %s",
                        type(error).__name__, error)  # fmt: skip
