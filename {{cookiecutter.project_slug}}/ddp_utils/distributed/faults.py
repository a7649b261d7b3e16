"""Faults: the error types, stop signals, the watchdog, what each step's agreement decides, and
the exit path.

Rules: a decision that ends or skips work is agreed by every rank (collectives.Agreement) before it is
acted on; an error every rank agrees on is a `TrainingError` or `CheckpointError`, reported
once without a traceback; anything else means the ranks are out of step: the root cause is
logged first, on its rank, and the process exits without waiting for a peer (`exit_now`).
"""

import contextlib
import faulthandler
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.files import folder_lost
from ..core.logs import log, report
from ..errors import CheckpointError, DataUnavailable, OutOfMemory, Preempted, RankGone, TrainingError

FAILED_KEY = "failed"  # in the store: set by a rank that stops the job alone (OutOfMemory)


LAUNCHER_STOP_GRACE = 90  # scripts/launch.sh's and slurm.sbatch's STOP_GRACE_SECONDS unless told
TORCHRUN_STOP_WAIT = 30  # torchrun's own wait for its workers after passing a stop signal on


@dataclass(frozen=True)
class StopNotice:
    """What a stop signal gives, read from the launcher's variables in this one place.

    `grace_seconds`: from the signal to the kill of the whole job (STOP_GRACE_SECONDS, else the
    scripts' default); `workers_seconds`: the workers' part of it, torchrun's wait after passing
    the signal on (PET_SHUTDOWN_TIMEOUT: scripts/launch.sh sets it to STOP_GRACE_SECONDS less
    10 s for the launchers, past 20 s), else torchrun's own 30 s; `source`: where that comes from."""

    grace_seconds: int
    workers_seconds: int
    source: str


def stop_notice(environ=os.environ):
    """The StopNotice of this job's launcher, from its environment."""
    grace, wait = (environ.get(name, "") for name in ("STOP_GRACE_SECONDS", "PET_SHUTDOWN_TIMEOUT"))
    grace, wait = (int(value) if value.isdigit() else None for value in (grace, wait))
    if wait is None and grace is not None:
        wait = grace - 10 if grace > 20 else grace  # scripts/launch.sh's rule, written there in shell
    if wait is None:
        source = f"no STOP_GRACE_SECONDS (not scripts/launch.sh): torchrun's own {TORCHRUN_STOP_WAIT} s"
        wait = TORCHRUN_STOP_WAIT
    else:
        source = f"STOP_GRACE_SECONDS {grace}" if grace is not None else f"PET_SHUTDOWN_TIMEOUT {wait}"
    return StopNotice(LAUNCHER_STOP_GRACE if grace is None else grace, wait, source)


class StopRequest:
    """Remember a SIGTERM (torchrun, Kubernetes) or SIGUSR1 (SLURM --signal) for the loop.

    The handler only sets a flag: the loop agrees on it with the other ranks at the next
    step boundary, saves a checkpoint and exits. Doing work inside a signal handler could
    interrupt a collective halfway.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    @property
    def requested(self):
        return self.signum != 0


def write_stop_status(code):
    """Tell scripts/launch.sh that training stopped on a signal, its checkpoint saved: `code` is
    the process's exit status (128 + the signal's number), None clears it. torchrun exits 1
    after a signal whatever its workers did; launch.sh exits with this status instead."""
    path = os.environ.get("STOP_STATUS_FILE")
    if path:
        Path(path).write_text("" if code is None else f"{code}\n")


class Watchdog:
    """Say where this rank is stuck before the collective timeout ends the job.

    The loop calls `beat("train step 12")` as it goes. A daemon thread checks that a beat came
    within 90% of `timeout_seconds` (the collective timeout); if not, it logs which phase this
    rank has been stuck in and writes every thread's Python stack to stderr (faulthandler),
    once per stall. It looks often enough to do so before the timeout: every rank that is
    stuck reports, so the output shows which ranks were waiting where, the one stuck in its
    own code and the others waiting for it inside a collective. A stop signal during a stall
    in Python code (a stuck data read, a sleep) ends the process at once; a rank blocked inside
    a collective sees the signal only when the collective returns or times out.
    """

    def __init__(self, timeout_seconds, rank, stop):
        self.seconds = 0.9 * timeout_seconds
        self.period = min(1.0, 0.04 * timeout_seconds)  # reports land between 90% and 94%
        self.rank, self.stop = rank, stop
        self.phase, self.last_beat, self.reported, self.limit = "start-up", time.monotonic(), False, self.seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase, seconds=None):
        """Progress in `phase`; `seconds` allows a longer stall for this phase (checkpoint I/O)."""
        self.phase, self.last_beat, self.reported = phase, time.monotonic(), False
        self.limit = seconds or self.seconds

    def _watch(self):
        while not self._stop.wait(self.period):
            stalled = time.monotonic() - self.last_beat
            if stalled > self.limit and not self.reported:
                self.reported = True
                log.error(
                    "rank %d: no progress for %.0f s in %s; Python stacks of this rank follow on stderr",
                    self.rank,
                    stalled,
                    self.phase,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            if self.reported and self.stop.requested:
                # A stalled loop can never act on the stop request (and save); end now
                # rather than when the launcher's grace period runs out.
                log.error("rank %d: stop requested while stalled in %s; exiting", self.rank, self.phase)
                logging.shutdown()
                os._exit(1)

    def close(self):
        self._stop.set()


# How a collective that ran past --timeout_seconds fails: gloo raises a RuntimeError from the
# operation (backward's all-reduce included), NCCL's watchdog reports the stuck work.
COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (send|recv) operation|Watchdog caught collective operation timeout"
)


def is_collective_timeout(error):
    """Whether `error` is a collective that ran past its timeout: not any error that says
    "timed out" (a DataLoader's `timeout`, a socket, a file system)."""
    return isinstance(error, RuntimeError) and COLLECTIVE_TIMEOUT.search(str(error)) is not None


_exit_hooks = []  # quick, local clean-ups before exit_now (the folder claim let go of)


def at_exit_now(hook):
    """Run `hook()` when this process exits at once (exit_now), until `not_at_exit_now(hook)`."""
    _exit_hooks.append(hook)


def not_at_exit_now(hook):
    if hook in _exit_hooks:
        _exit_hooks.remove(hook)


def exit_now(code):
    """Exit at once, the logs flushed, without destroying the process group: after an error a
    peer may be gone, and waiting for it would hide nothing but could block forever."""
    for hook in list(_exit_hooks):
        with contextlib.suppress(Exception):
            hook()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StepChecks:
    """What every optimizer step agrees on with the other ranks (a stop request, a non-finite
    loss or gradients, fp16's loss scale, the output folder taken over) and what the agreement
    decides: stop, go on, or a `TrainingError` that names the knob to turn.

    Every decision that ends or skips work is agreed by one small all-reduce per step, so no
    rank stops alone while the others wait in the next all-reduce. It runs while the next step
    is computed and is read one step later: the host never waits for the device. A stop
    therefore takes effect one or two optimizer steps after the signal; a non-finite step is
    caught one step later, before any checkpoint can hold it.
    """

    def __init__(self, cfg, fp16):
        self.cfg, self.fp16 = cfg, fp16
        self.skipped_in_a_row = 0  # fp16 steps skipped for overflow, in a row
        self.in_flight = None  # (step, collectives.Agreement, this rank's flags) of the last step

    def agree(self, step, agreement, flags, epoch):
        """Keep optimizer step `step`'s agreement (`flags`, summed over the ranks by `agreement`)
        in flight and act on the previous step's; returns whether all ranks agreed to stop."""
        previous, self.in_flight = self.in_flight, (step, agreement, flags)
        return self._decide(previous, epoch)

    def read(self, epoch):
        """Act on the last step's agreement now (before a checkpoint or the epoch's end)."""
        previous, self.in_flight = self.in_flight, None
        return self._decide(previous, epoch)

    def _decide(self, in_flight, epoch):
        if in_flight is None:
            return False
        step, agreement, flags = in_flight
        return self.decide(agreement.result(), step, epoch)

    def wait(self):
        """Until no agreement of this rank is in flight (locally: no new collective)."""
        if self.in_flight is not None:
            self.in_flight[1].wait()

    def flags(self, stop_requested, loss_sum, norm, scale, new_scale):
        """The step's flags and values, for collectives.Agreement (which sums them over the ranks):
        `loss_sum` this rank's loss total, `norm` the gradients' (None when not measured),
        `scale` and `new_scale` fp16's loss scale before and after the step (tensors on the
        device: compared there, read by the host only when the agreement is, a step later);
        last, whether rank 0 knows its folder claim lost (files.folder_lost: no file read)."""
        low_scale = skipped = False
        if self.fp16:
            low_scale, skipped = new_scale < self.cfg.min_loss_scale, new_scale < scale
        lost = folder_lost() is not None
        return stop_requested, loss_sum, 0.0 if norm is None else norm, low_scale, skipped, lost

    def decide(self, agreed, step, epoch):
        """Act on the agreed flags of optimizer step `step` (in 0-based `epoch`): raise for a
        failure, else return whether all ranks agreed to stop. Called once per step, in order."""
        stops, loss_sum, norm, low_scales, skipped, lost = agreed  # flags count the ranks that raised them
        if lost:  # the folder is another run's: stop before anything more is written there
            raise TrainingError(folder_lost() or "the output folder was taken over by another run (rank 0 says which)")
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        too_many_skips = 0 < self.cfg.max_skipped_steps <= self.skipped_in_a_row
        loss_not_finite, grads_not_finite = not math.isfinite(loss_sum), not math.isfinite(norm)
        where = f"at optimizer step {step} (epoch {epoch + 1})"
        fixes = "lower --lr or set --max_grad_norm" + (", or train with --amp bf16" if self.fp16 else "")
        if loss_not_finite or (grads_not_finite and not self.fp16):  # fp16: an overflow skips the step
            raise TrainingError(f"loss or gradients are not finite {where}; {fixes}")
        if low_scales:
            raise TrainingError(
                f"the fp16 loss scale fell below --min_loss_scale {self.cfg.min_loss_scale:g} {where}: gradients "
                f"overflow at any scale; {fixes}"
            )
        if too_many_skips:
            raise TrainingError(
                f"{self.cfg.max_skipped_steps} optimizer steps in a row skipped for fp16 overflow, up to step "
                f"{step} (--max_skipped_steps); {fixes}"
            )
        return stops > 0


def another_rank_failed(store):
    """Whether a rank has stopped the job alone and said why (FAILED_KEY)."""
    try:
        return store is not None and store.check([FAILED_KEY])
    except Exception:  # the store is gone too
        return False


class ExitPath:
    """How a run ends, as an exit code, whatever it raised; `trainer` (set once built) is closed
    on every path. Around the run in run.py:

        with ExitPath(ctx, cfg.timeout_seconds) as ending:
            trainer = ending.watch(Trainer(cfg, ctx, task, datasets))
            ...
        return ending.code

    - a TrainingError or CheckpointError (agreed by every rank): reported once, exit 1;
    - Preempted (an agreed stop, the checkpoint saved): exit 128 + the signal, also written
      for scripts/launch.sh (write_stop_status);
    - anything else: the ranks are out of step. The root cause is logged first, on this rank
      (a collective timeout as one line naming --timeout_seconds), then the process exits at
      once (exit_now): destroying the process group may block on a peer that is gone.
    """

    def __init__(self, ctx, timeout_seconds):
        self.ctx, self.timeout_seconds = ctx, timeout_seconds
        self.trainer = None  # needs .close(status), .checkpointer.wait(), .step, .watchdog.phase
        self.code = 0

    def watch(self, trainer):
        """`trainer`, closed on every way out of the block."""
        self.trainer = trainer
        return trainer

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        trainer, status = self.trainer, "failed"
        try:
            if error is None:
                status = "finished"
            elif isinstance(error, (TrainingError, CheckpointError)):
                report("%s", error, level=logging.ERROR)
                if trainer is not None:  # every rank is here (the error was agreed): finish a save in flight
                    with contextlib.suppress(CheckpointError):
                        trainer.checkpointer.wait()
                self.code = 1
            elif isinstance(error, Preempted):
                status, self.code = "preempted", 128 + error.signum
                report("stopped by %s at step %d; checkpoint saved, run the same command to resume", error,
                       trainer.step)  # fmt: skip
                write_stop_status(self.code)
            elif isinstance(error, (OutOfMemory, DataUnavailable)):
                # The first rank out of memory (or without its data) says so; the others leave without a word (each
                # rank's heartbeat thread watches the key: store_waits.Heartbeats).
                if self.ctx.store is None or self.ctx.store.add(FAILED_KEY + "/count", 1) == 1:
                    log.error("%s", error)
                if self.ctx.store is not None:
                    self.ctx.store.set(FAILED_KEY, str(error))
                status = "crashed"
            elif isinstance(error, Exception):
                if another_rank_failed(self.ctx.store):
                    pass  # this rank's error follows from it (a peer gone mid-collective): its line says why
                elif isinstance(error, RankGone):  # the root cause is the other rank's: one line
                    log.error("%s", error)
                elif is_collective_timeout(error):
                    log.error(
                        "rank %d: a collective timed out after --timeout_seconds %d during %s: another rank stalled "
                        "or died (see the ranks' stacks above)",
                        self.ctx.rank, self.timeout_seconds, trainer.watchdog.phase if trainer else "start-up",
                    )  # fmt: skip
                else:
                    log.error("rank %d failed", self.ctx.rank, exc_info=error)
                status = "crashed"  # the trackers are left as they are: closing one may wait on its server
            else:  # KeyboardInterrupt and the like: on its way out as it is
                return False
            return True
        finally:
            if trainer is not None:
                trainer.close(status)
            if status == "crashed":
                exit_now(1)
