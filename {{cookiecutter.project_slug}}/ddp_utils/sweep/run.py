"""sweep.py's main: a sweep of short training runs with Optuna (pip install -e ".[sweep]").

    python sweep.py experiments/sweep_lr_adamw.toml            # a worker: trials until the sweep is done
    python sweep.py experiments/sweep_lr_adamw.toml --report   # the results so far, from the storage
    python sweep.py --curves runs/a runs/b --out curves.png     # any runs' loss curves side by side

Every worker started with the same file works on one study in one storage (a journal file in
the sweep's folder, or an RDB URL): several on one machine, a SLURM job array, or one after
another. Each trial is a training run through scripts/launch.sh in a folder of its own; its
evaluation lines reach Optuna's pruner as they are written, and a pruned trial is stopped with
the stop signal of a preemption, its checkpoint and metrics kept. A worker beats every
heartbeat_seconds in its trial's record; a trial whose worker stopped beating, and whose run has
let go of its folder, is marked failed by another worker and run again from its checkpoint (the
same folder). The same command started again continues the study. docs/sweeps.md has the
file's keys and an example.
"""

import os
import re
import secrets
import signal
import socket
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from urllib.parse import unquote

from ..core.logs import print_error
from ..errors import InputError
from ..knobs import OneLineParser
from .file import read_sweep
from .trial import (
    evaluation_lines,
    failure_reason,
    is_finite,
    reported_metrics,
    run_holds_folder,
    start_trial,
    stop,
    trial_job,
    wait_for,
)

MISSED_BEATS = 3  # heartbeats a running trial's worker may miss before the trial is retried


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise InputError('sweeps need Optuna: pip install -e ".[sweep]"') from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_storage(sweep):
    """The study's storage and a lock for asking for trials (the journal file's own lock; an
    RDB has none: two workers asking at once may start one trial beyond the count)."""
    optuna = import_optuna()
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    url = sweep.storage
    if "://" in url:
        try:
            storage = optuna.storages.RDBStorage(url)
        except Exception as error:  # the driver's own errors: a host not found, a refused login
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InputError(
                f"{sweep.path}: sweep.storage {masked(url, url)}: cannot open it: {masked(first, url)}"
            ) from None
        return storage, nullcontext
    journal = Path(url) if url else sweep.journal
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
        journal.touch()
    except OSError as error:
        raise InputError(
            f"{sweep.path}: sweep.storage {journal}: cannot write the journal there: {error.strerror}"
        ) from None
    lock = JournalFileOpenLock(str(journal))
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal), lock_obj=lock))
    ask_lock = JournalFileOpenLock(str(journal) + ".ask")

    class Asking:
        def __enter__(self):
            ask_lock.acquire()

        def __exit__(self, *exc):
            ask_lock.release()

    return storage, Asking


def masked(text, url):
    """`text` with the password of the storage URL `url` shown as *** wherever its `:password@`
    appears: error lines land in SLURM's output files, which others on a shared cluster often read."""
    netloc = re.split(r"[/?#]", url.partition("://")[2], maxsplit=1)[0]
    password = netloc.rpartition("@")[0].partition(":")[2]
    for secret in filter(None, {password, unquote(password)}):  # as written, and as a driver decodes it
        text = text.replace(f":{secret}@", ":***@")
    return text


def load_study(sweep, storage):
    optuna = import_optuna()
    # Workers started with one seed would draw the same parameters: each adds a random number of
    # its own (not its process id, which workers in containers often share: 1).
    seed = (sweep.seed + secrets.randbits(32)) % 2**32
    if sweep.grid:
        sampler = optuna.samplers.GridSampler(sweep.grid, seed=sweep.seed)  # one order for every worker
    elif sweep.sampler == "random":
        sampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        sampler = optuna.samplers.TPESampler(n_startup_trials=min(5, sweep.trials), seed=seed)
    if sweep.pruner == "median":
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=sweep.startup_trials, n_warmup_steps=sweep.prune_after_steps
        )
    else:
        pruner = optuna.pruners.NopPruner()
    study = optuna.create_study(
        study_name=sweep.name, storage=storage, sampler=sampler, pruner=pruner,
        direction=sweep.direction, load_if_exists=True,
    )  # fmt: skip
    known = study.user_attrs.get("reported_metrics")
    if known and sweep.metric not in known:
        raise metric_not_reported(sweep, known)
    if study.direction.name.lower() != sweep.direction:
        started = study.direction.name.lower()
        raise InputError(f"{sweep.path}: sweep.direction {sweep.direction}: study {sweep.name} in this storage "
                         f"was started to {started}: give the sweep another name")  # fmt: skip
    return study


def metric_not_reported(sweep, names):
    import difflib

    close = difflib.get_close_matches(sweep.metric, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return InputError(f"{sweep.path}: sweep.metric {sweep.metric} is not reported by the task{hint}: "
                      f"its metrics.jsonl has {', '.join(names)}")  # fmt: skip


def suggest(trial, knobs):
    params = {}
    for name, knob in knobs.items():
        if knob.kind in ("log_uniform", "uniform"):
            params[name] = trial.suggest_float(name, *knob.values, log=knob.log)
        elif knob.kind in ("int", "log_int"):
            params[name] = trial.suggest_int(name, *knob.values, log=knob.log)
        else:
            params[name] = trial.suggest_categorical(name, list(knob.values))
    return params


def counted(trials):
    """Trials that count toward the sweep's number: all but those failed and retried."""
    return [t for t in trials if not (t.state.name == "FAIL" and t.user_attrs.get("retried"))]


class Worker:
    def __init__(self, sweep, study, asking, root):
        self.sweep, self.study, self.asking, self.root = sweep, study, asking, root
        self.name = f"{socket.gethostname()} pid {os.getpid()}"
        self.signal = None
        self.beats = 0  # this worker's heartbeats: a count, never a time (the hosts' clocks differ)
        self.seen = {}  # each running trial of the others: (its beat, this worker's clock when first seen)
        self.trial = self.process = None  # the trial this worker runs, and its run

    def request_stop(self, signum, frame):
        self.signal = signum

    def run(self):
        """Trials until the sweep has its number of trials ended; returns the exit code."""
        optuna = import_optuna()
        running = optuna.trial.TrialState.RUNNING
        while self.signal is None:
            with self.asking():
                self.reap()
                trials = self.study.get_trials(deepcopy=False)
                waiting = any(t.state.name == "WAITING" for t in trials)
                trial = self.study.ask() if waiting or len(counted(trials)) < self.sweep.trials else None
            if trial is None:
                if not any(t.state == running for t in self.study.get_trials(deepcopy=False)):
                    return 0
                time.sleep(self.sweep.heartbeat_seconds)  # another worker's trial may yet die: retry it
                continue
            self.run_trial(trial)
        return 128 + self.signal

    def beat(self, trial):
        self.beats += 1
        trial.set_user_attr("beat", self.beats)

    def reap(self):
        """Retry the trials whose worker stopped beating (killed, its machine lost) and whose run
        has let go of its folder. A trial's beat is watched on this worker's own clock: unchanged
        for MISSED_BEATS heartbeats, its worker is silent; no two hosts' clocks are compared."""
        now, patience = time.monotonic(), MISSED_BEATS * self.sweep.heartbeat_seconds
        seen = {}
        for t in self.study.get_trials(deepcopy=False):
            if t.state.name != "RUNNING" or (self.trial is not None and t._trial_id == self.trial._trial_id):
                continue
            beat = t.user_attrs.get("beat")
            previous = self.seen.get(t._trial_id)
            seen[t._trial_id] = previous if previous is not None and previous[0] == beat else (beat, now)
            silent = now - seen[t._trial_id][1]
            if silent <= patience:
                continue
            # A silent worker whose run trains on (stopped by Ctrl-Z, stalled on a slow journal)
            # keeps its trial: it may yet wake and tell the result; if not, the run ends at its
            # last step and its retry resumes there, its result kept.
            out, first = t.user_attrs.get("output_dir"), t.user_attrs.get("retry_of", t.number)
            if out and run_holds_folder(out, trial_job(self.sweep.name, first)):
                continue
            who = t.user_attrs.get("worker", "its worker")
            self.retry(t, f"its worker ({who}) stopped: no heartbeat for {silent:.0f} s")
        self.seen = seen

    def retry(self, t, reason):
        """Mark trial `t` failed with `reason` and, unless it has had its retries, queue it again
        with the same parameters and folder (its run resumes from its checkpoint). Only the
        worker whose update lands first queues the retry."""
        optuna = import_optuna()
        storage = self.study._storage
        attempt = t.user_attrs.get("attempt", 1)
        again = attempt <= self.sweep.retries
        note = "; run again from its checkpoint" if again else f"; not run again ({self.sweep.retries} retries)"
        try:
            storage.set_trial_user_attr(t._trial_id, "reason", reason + note)
            storage.set_trial_user_attr(t._trial_id, "retried", again)
            storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # another worker got there first
        print(f"sweep.py: trial {t.number} fail: {reason}{note}", flush=True)
        if again:
            first = t.user_attrs.get("retry_of", t.number)
            self.study.enqueue_trial(t.params, user_attrs={"retry_of": first, "attempt": attempt + 1})

    def run_trial(self, trial):
        optuna = import_optuna()
        self.trial = trial
        try:
            self.train(trial)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed by another worker while this one was stopped or stalled past MISSED_BEATS
            # heartbeats and its run had let go of the folder (or looked gone): the retry is
            # queued for that folder. This attempt's run, if it trains on, stops (its checkpoint
            # kept) for the retry to resume; this worker goes on with the sweep.
            ended = self.process is not None and self.process.poll() is not None
            if self.process is not None:
                stop(self.process)
                wait_for(self.process, float("inf"))
            reason = self.study._storage.get_trial(trial._trial_id).user_attrs.get("reason", "")
            print(f"sweep.py: trial {trial.number} was failed by another worker while this one was stalled "
                  f"({reason}); its run {'had ended' if ended else 'stopped'}, its folder left to the retry",
                  flush=True)  # fmt: skip
        finally:
            self.trial = self.process = None

    def train(self, trial):
        """Run `trial` to its end and tell the study how it ended (raises UpdateFinishedTrialError
        when another worker failed it meanwhile)."""
        optuna = import_optuna()
        sweep = self.sweep
        params = suggest(trial, sweep.knobs)
        first = trial.user_attrs.get("retry_of", trial.number)
        out = (sweep.folder / "trials" / f"trial_{first:04d}").resolve()
        log_path = sweep.folder / "logs" / f"trial_{first:04d}.log"
        trial.set_user_attr("output_dir", str(out))
        trial.set_user_attr("worker", self.name)
        trial.set_user_attr("processes", sweep.processes)  # best_config.toml's rerun line starts as many
        self.beat(trial)
        offset = log_path.stat().st_size if log_path.exists() else 0
        print(f"sweep.py: trial {trial.number} {params_text(params)}" + (f" (again, trial {first}'s folder)"
              if first != trial.number else ""), flush=True)  # fmt: skip
        # A retry's folder holds the dead attempt's metrics.jsonl: read it once the resumed run
        # has rewritten it (cut back to its checkpoint, which it resumes exactly).
        before = file_stamp(out / "metrics.jsonl")
        started = time.monotonic()
        process = self.process = start_trial(self.root, sweep.trial_flags(params, out), log_path, sweep.processes,
                                             job=trial_job(sweep.name, first))  # fmt: skip
        reported, outcome, last_beat = {}, None, time.monotonic()
        while True:
            code = process.poll()
            if time.monotonic() - last_beat >= sweep.heartbeat_seconds:
                self.beat(trial)
                last_beat = time.monotonic()
                self.reap()
            fresh = before is None or file_stamp(out / "metrics.jsonl") != before
            for record in evaluation_lines(out / "metrics.jsonl") if fresh else []:
                if outcome is not None or record["step"] in reported:
                    continue
                outcome = self.judge(trial, record, reported)
                if outcome is not None:
                    stop(process)
            if code is not None:
                break
            if self.signal is not None:
                stop(process)
                wait_for(process, float("inf"))
                self.retry(trial, f"its worker ({self.name}) was stopped by signal {self.signal}")
                return
            time.sleep(0.5)
        seconds = time.monotonic() - started
        steps = max(reported, default=0)
        trial.set_user_attr("steps", steps)
        trial.set_user_attr("seconds", round(seconds, 1))
        state = optuna.trial.TrialState
        if outcome and outcome[0] == "missing":
            trial.set_user_attr("reason", outcome[1])
            self.tell(trial, state=state.FAIL)
            self.study.set_user_attr("reported_metrics", outcome[2])
            raise metric_not_reported(sweep, outcome[2])
        if outcome and outcome[0] == "pruned":
            trial.set_user_attr("reason", outcome[1])
            self.tell(trial, state=state.PRUNED)
        elif outcome and outcome[0] == "diverged":
            trial.set_user_attr("reason", outcome[1])
            self.tell(trial, state=state.FAIL)
        elif code == 0 and reported:
            self.tell(trial, reported[steps])
        elif code == 0:
            trial.set_user_attr("reason", f"the run wrote no evaluation line with {sweep.metric} "
                                          "(set [flags] eval_every_steps)")  # fmt: skip
            self.tell(trial, state=state.FAIL)
        else:
            trial.set_user_attr("reason", failure_reason(log_path, code, offset))
            self.tell(trial, state=state.FAIL)
        ended = self.study._storage.get_trial(trial._trial_id)
        value = f" {sweep.metric} {ended.value:.6g}" if ended.value is not None else ""
        reason = ended.user_attrs.get("reason", "")
        print(f"sweep.py: trial {trial.number} {ended.state.name.lower()}{value} after {steps} steps, {seconds:.0f} s"
              + (f": {reason}" if reason else ""), flush=True)  # fmt: skip

    def tell(self, trial, value=None, state=None):
        """study.tell, whose result is stored whatever the sampler does after it: the grid
        sampler calls Study.stop (which only optimize() may) when its grid is used up, and
        reads a grid position that a retried trial, queued with its parameters, has not."""
        optuna = import_optuna()
        try:
            self.study.tell(trial, value, state=state)
        except (RuntimeError, KeyError):
            if self.study._storage.get_trial(trial._trial_id).state.name in ("RUNNING", "WAITING"):
                raise
        except ValueError:  # "Cannot tell a FAIL trial": another worker failed it since this one's last beat
            if self.study._storage.get_trial(trial._trial_id).state.is_finished():
                raise optuna.exceptions.UpdateFinishedTrialError(f"trial {trial.number} was failed meanwhile") from None
            raise

    def judge(self, trial, record, reported):
        """What an evaluation line means for the trial: None (go on), or why to stop it."""
        sweep, step = self.sweep, record["step"]
        if sweep.metric not in record:
            names = reported_metrics(record)
            return ("missing", f"sweep.metric {sweep.metric} is not in metrics.jsonl", names)
        value = record[sweep.metric]
        if not is_finite(value):
            return ("diverged", f"{sweep.metric} is {value} at step {step}: the run diverged")
        reported[step] = value
        trial.report(value, step)
        if sweep.pruner != "none" and trial.should_prune():
            return ("pruned", f"pruned at step {step}: {sweep.metric} {value:.6g} behind the other trials")
        return None


def file_stamp(path):
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def params_text(params):
    return " ".join(f"--{name} {value:.4g}" if isinstance(value, float) else f"--{name} {value}"
                    for name, value in params.items())  # fmt: skip


def parse_args(argv):
    parser = OneLineParser(
        prog="sweep.py",
        description="Sweep Config fields with Optuna: each trial a training run (docs/sweeps.md).",
    )
    parser.add_argument("sweep_file", nargs="?", help="the sweep's TOML file (experiments/sweep_*.toml)")
    parser.add_argument("--report", action="store_true", help="write the results from the storage, run no trial")
    parser.add_argument("--curves", nargs="+", metavar="RUN", help="runs' folders (or metrics.jsonl files) to draw")
    parser.add_argument("--out", default="curves.png", help="the picture --curves writes")
    args = parser.parse_args(argv)
    if not args.sweep_file and not args.curves:
        parser.error("give a sweep file (python sweep.py experiments/sweep_lr_adamw.toml), or --curves RUN...")
    return args


def main(task, argv=None, root=None):
    """Run sweep.py for `task` (contract.Task); returns the exit code. `root` is the project
    folder (scripts/launch.sh's): the folder of the entry point by default."""
    from .results import write_curves, write_results

    args = parse_args(argv)
    try:
        if args.curves:
            write_curves([Path(p) for p in args.curves], Path(args.out))
            print(f"sweep.py: wrote {args.out}")
            return 0
        sweep = read_sweep(args.sweep_file, task.config)
        storage, asking = open_storage(sweep)
        study = load_study(sweep, storage)
        code = 0
        if not args.report:
            root = Path(root or Path(sys.argv[0]).resolve().parent)
            worker = Worker(sweep, study, asking, root)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(signum, worker.request_stop)
            code = worker.run()
        write_results(sweep, study)
        return code
    except InputError as error:
        print_error(str(error))
        return 2
