"""Without a progress bar (stdout not a terminal), rank 0 is never silent for long: a line at
least every --progress_every_seconds with the step of the planned total, the time per step, the
time left and a loss (ddp_utils/observe/progress.py: ProgressLine). Its only effect is that line."""

import logging
import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_parameters, read_metrics, run_training

from config import Config
from ddp_utils.observe import metrics, progress

DURATION = r"\d+\.\ds|\d+m\d\ds|\d+h\d\dm"  # progress.format_duration
LINE = re.compile(
    rf"\[rank (\d+)\] INFO progress: step (\d+)/(\d+) \(\d+%\), [\d.]+ m?s/step, ({DURATION}) left, loss (\S+) "
)
STEPS_A_LINE = 5  # the interval of the run with lines: about this many of the task's steps


def train_seconds(line):
    return line["compute_s"] + line["data_wait_s"]  # the metrics period's training time


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The TINY run with progress lines off, then again with a line every few steps (an interval
    of STEPS_A_LINE steps, as long as the first run's steps took: whatever the task's model).
    Returns {"off"/"on": (output folder, stdout and stderr)} and the interval."""
    flags = ["--log_every_steps", "0"]  # no loss lines: they would count as lines
    off = tmp_path_factory.mktemp("progress_off")
    result = run_training(off, *flags, "--progress_every_seconds", 0, nproc=2)
    done = {"off": (off, result.stdout + result.stderr)}
    lines = read_metrics(off)
    steps = lines[-1]["step"] - (lines[-2]["step"] if len(lines) > 1 else 0)
    interval = max(STEPS_A_LINE * train_seconds(lines[-1]) / steps, 0.005)  # the steady period's steps
    on = tmp_path_factory.mktemp("progress_on")
    result = run_training(on, *flags, "--progress_every_seconds", f"{interval:.4f}", nproc=2)
    done["on"] = (on, result.stdout + result.stderr)
    return done, float(f"{interval:.4f}")


def test_progress_lines_from_rank_zero_once_per_interval(runs):
    (output_dir, output), interval = runs[0]["on"], runs[1]
    lines = LINE.findall(output)
    assert output.count("progress: step") == len(lines), output  # every one in the expected form
    assert len(lines) >= 2, output  # the run spans many intervals
    assert {rank for rank, *_ in lines} == {"0"}
    # About one an interval of training, not one a step, nor one a rank: a line comes a step
    # early when the next would end past the interval; each metrics period restarts the clock
    # (slack for its first line, and for a checkpoint's time).
    periods, steps_before = read_metrics(output_dir), 0
    bound = 0
    for line in periods:
        step_seconds = train_seconds(line) / (line["step"] - steps_before)
        bound += train_seconds(line) / max(interval - step_seconds, step_seconds) + 2
        steps_before = line["step"]
    assert len(lines) <= bound, (len(lines), bound, periods)
    steps = [int(step) for _, step, *_ in lines]
    planned = periods[-1]["step"]  # the run trained all it planned
    assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] <= planned
    assert {int(total) for _, _, total, *_ in lines} == {planned}
    assert all(math.isfinite(float(loss)) for *_, loss in lines)


def test_no_progress_lines_when_off_and_the_same_training_either_way(runs):
    output_dir, output = runs[0]["off"]
    assert "progress:" not in output
    assert_same_parameters(output_dir, runs[0]["on"][0])  # the line changes nothing that is computed


def test_a_progress_line_is_due_when_the_next_step_would_end_past_the_interval():
    assert not progress.progress_due(10.0, 9.5, 1.0)
    assert progress.progress_due(10.0, 9.0, 1.0)
    assert progress.progress_due(10.0, 9.5, 1.0, step_seconds=0.6)  # the next step ends 1.1 s after the line
    assert not progress.progress_due(10.0, 9.5, 1.0, step_seconds=0.4)
    assert not progress.progress_due(1e9, 0.0, 0.0)  # 0 = off


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Unreadable:
    """A loss that fails when read."""

    def float(self):
        raise RuntimeError("device lost")


@pytest.fixture
def captured(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("train"), "propagate", True)  # setup_logging turns it off
    with caplog.at_level(logging.INFO, logger="train"):
        yield caplog


def period(seconds_per_step):
    return SimpleNamespace(seconds_per_step=lambda step, now: seconds_per_step)


def progress_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]


def test_progress_line_counts_any_line_and_reads_the_loss_only_when_due(captured):
    clock = Clock()
    progress_line = progress.ProgressLine(1.0, clock=clock)
    loss = torch.tensor(2.5)
    for step in (1, 2, 3):  # steps of 0.25 s: step 4 would end 1 s after the start
        clock.now = step * 0.25
        progress_line.step_done(step, 11, loss if step == 3 else Unreadable(), period(0.25))
    (line,) = progress_lines(captured)
    assert line.startswith("progress: step 3/11 (27%), 250.0 ms/step, 2.0s left, loss 2.5000")
    clock.now = 1.2
    progress_line.printed()  # a loss line: the next progress line is due about a whole interval later
    clock.now = 1.6
    progress_line.step_done(4, 11, Unreadable(), period(0.25))
    clock.now = 2.0
    progress_line.step_done(5, 11, loss, period(0.25))
    assert len(progress_lines(captured)) == 2


def test_progress_line_failure_turns_it_off_and_training_goes_on(captured):
    clock = Clock()
    progress_line = progress.ProgressLine(1.0, clock=clock)
    clock.now = 5.0
    progress_line.step_done(3, 10, Unreadable(), period(0.5))  # no exception
    assert progress_line.every == 0
    assert any("progress line failed" in r.getMessage() for r in captured.records)


@pytest.mark.parametrize(
    "is_main, tty, every", [(True, False, 30.0), (False, False, 0.0), (True, True, 0.0)]
)  # fmt: skip
def test_progress_lines_on_rank_zero_without_a_bar_only(monkeypatch, tmp_path, is_main, tty, every):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    ctx = SimpleNamespace(is_main=is_main, device=torch.device("cpu"))
    reporter = metrics.Reporter(ctx, Config(), tmp_path)
    assert metrics.Meter(Config(), ctx, reporter, throughput=None).progress_line.every == every


def test_time_per_step_leaves_out_the_first_step_and_checkpoints():
    timing = metrics.Period(0.0, 0.0, 0, window=(10.0, 64, 0.0), first_step=1)
    assert timing.seconds_per_step(5, now=18.0) == 2.0  # 4 steps in 8 s
    timing.checkpoint_s = 4.0
    assert timing.seconds_per_step(5, now=18.0) == 1.0
    assert metrics.Period(0.0, 0.0, 0).seconds_per_step(1, now=3.0) is None  # no step yet
    assert metrics.Period(0.0, 0.0, 0, window=(3.0, 64, 0.0), first_step=1).seconds_per_step(1, now=3.0) == 3.0


def test_a_loss_line_or_a_metrics_period_restarts_the_interval(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    ctx = SimpleNamespace(is_main=True, device=torch.device("cpu"))
    meter = metrics.Meter(Config(log_every_steps=1), ctx, metrics.Reporter(ctx, Config(), tmp_path), None)
    clock = meter.progress_line.clock = Clock()
    one = torch.tensor(1.0)
    meter.loss_log.record(1, one, one, None, 0.1, 100.0)  # kept back a step
    clock.now = 5.0
    meter.loss_log.record(2, one, one, None, 0.1, 100.0)  # step 1's loss line: a line now
    assert meter.progress_line.last_line == 5.0
    clock.now = 9.0
    meter.start_period(samples=0)  # training starts, or a metrics line was written
    assert meter.progress_line.last_line == 9.0


@pytest.mark.parametrize("max_steps, planned", [(0, 2 * 16), (50, 50)])
def test_the_planned_steps_are_max_steps_or_every_epoch(tmp_path, max_steps, planned):
    reporter = metrics.Reporter(SimpleNamespace(is_main=True), Config(max_steps=max_steps), tmp_path)
    reporter.start_epoch(1, 2, 16, 0)
    assert reporter.planned_steps == planned
