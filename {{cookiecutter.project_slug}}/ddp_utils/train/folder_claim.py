"""One run owns its output folder. Before a run writes anything there, global rank 0 claims
--output_dir (the file output_dir/.owner.json, created only if absent) and keeps the claim alive
while the run lives (a heartbeat: the file's time is renewed every BEAT_SECONDS); the run lets
go of it when it ends. Another start into a claimed folder:

- proceeds, taking the claim over with a line saying so, when its owner is gone: on the same
  machine, its process no longer exists (killed, crashed); on another machine, the claim has
  not been renewed for STALE_SECONDS (its host lost or its processes killed). The age is read
  on the file system's own clock, the claim's time against a file the newcomer writes beside it,
  so the hosts' clocks are never compared; a claim that looks old is then watched on this
  process's own clock for a few heartbeats before it is taken, so a clock that is off cannot
  take a live claim;
- waits, when the owner is an earlier start of the same job (job_identity: a restart, a
  requeue, a replacement pod), until the owner lets go or is gone, at most STALE_SECONDS plus
  the stop notice; it is refused if the owner still holds the folder then;
- is refused at once otherwise: one line naming the owner (host, process, start time, job).

A run whose claim was taken over (it stalled past STALE_SECONDS: a paused VM, a stopped
process, a host cut off from the file system) writes nothing more there: the claim's token is
the fence (files.fenced) that every write another run could lose checks first, on every rank
(a checkpoint, its shards and `last` published, pruning, metrics lines, the resolved config),
and its temporary names carry the writer's token (files.WRITER): a stalled writer's never name
the new owner's. Once the loss is seen (by the heartbeat within a beat, or by the first log
line or step after a stall), train.log, the new owner's file now, gets no more lines and the
run stops at its next optimizer step on every rank, with one line naming the new owner.
docs/checkpoints.md (One run per folder) has the rules for each launcher.
"""

import errno
import json
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ..core.files import fence
from ..core.logs import log, stop_file_logging
from ..distributed.faults import at_exit_now, not_at_exit_now, stop_notice
from ..distributed.store_waits import share_from_main
from ..errors import ClaimRefused, InputError

CLAIM_FILE = ".owner.json"
BEAT_SECONDS = 10  # how often the owner renews its claim
STALE_SECONDS = 120  # a claim from another machine not renewed for this long: its owner is gone
WATCH_BEATS = 3  # heartbeats a claim that looks stale is watched before it is taken


def job_identity(environ):
    """The job this process belongs to, the same for each of its restarts (None: each start
    is a job of its own): SLURM's job id (a requeue keeps it), TRAINING_JOB_ID (set by the
    Kubernetes manifests: the job's namespace and name), else torchrun's run id (one per
    torchrun command under --standalone, or launch.sh's RDZV_ID; "none" for a static
    rendezvous names no job)."""
    if environ.get("SLURM_JOB_ID"):
        return f"SLURM job {environ['SLURM_JOB_ID']}"
    if environ.get("TRAINING_JOB_ID"):
        return environ["TRAINING_JOB_ID"]
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun run {run_id}" if run_id not in ("", "none") else None


def claim_output_dir(ctx, output_dir, say):
    """Claim `output_dir` for this run; every rank calls it, before anything is written there.
    Returns the Claim (rank 0; others get one that holds nothing; its `note` says whose claim
    it took over) or raises InputError on every rank with rank 0's one line. `say(line)` tells
    that rank 0 waits for an earlier start (no log exists yet: nothing is written before the claim)."""
    wait_seconds = STALE_SECONDS + stop_notice(os.environ).grace_seconds
    claim = Claim(None, None)
    problem = None
    if ctx.is_main:
        try:
            claim = Claim.take(Path(output_dir), job_identity(os.environ), wait_seconds, say)
        except ClaimRefused as refused:
            problem = str(refused)
        except OSError as error:
            problem = f"cannot claim --output_dir {output_dir}: {error}"
    token = claim.owner["token"] if claim.owner else None
    problem, token = share_from_main(ctx, "folder_claim", [problem, token], wait_seconds + 60)
    if problem:
        raise InputError(problem)
    if not ctx.is_main and token:  # fenced too: its shards never land in a folder taken over
        claim = Claim(Path(output_dir) / CLAIM_FILE, {"token": token}, holder=False)
    return claim


class Claim:
    """Rank 0's hold on the folder (the `holder`): renewed by a daemon thread, let go by
    `release`. On the other ranks, the same claim's token, read back by their fence."""

    def __init__(self, path, owner, note=None, holder=True):
        self.path, self.owner, self.note, self.holder = path, owner, note, holder
        self.lost = None  # who took the claim over while this run was stalled (describe), once seen
        self.confirmed = time.monotonic()  # when the claim was last read back as this run's
        self._stop = threading.Event()
        if path is not None:
            fence(self.check, self.lost_line if holder else None)
            if holder:
                at_exit_now(self.release)  # a run that stops at once (out of memory) lets go of the folder too
                threading.Thread(target=self._beat, name="folder-claim", daemon=True).start()

    @classmethod
    def take(cls, folder, job, wait_seconds, say):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / CLAIM_FILE
        me = this_process(job)
        deadline = time.monotonic() + wait_seconds
        waiting, note = False, None
        while True:
            if _create(path, me):
                return cls(path, me, note)
            owner = read_claim(path)
            if owner is None:  # let go of (or taken) since we looked
                continue
            gone = why_gone(owner, path)
            if gone:
                if _set_aside(path, owner):
                    note = f"took over {folder} from {describe(owner)}: {gone}"
                continue
            if owner.get("written") is False:  # another start is writing its claim this moment
                time.sleep(0.1)
                continue
            if job is not None and owner.get("job") == job and time.monotonic() < deadline:
                if not waiting:
                    say(f"waiting up to {wait_seconds} s for the earlier start of this job ({describe(owner)}) "
                        f"to let go of {folder}")  # fmt: skip
                    waiting = True
                time.sleep(1)
                continue
            raise ClaimRefused(
                f"--output_dir {folder} belongs to a run in progress ({describe(owner)}): wait for it to end, "
                f"or pass another --output_dir (its claim: {path})"
            )

    def _beat(self):
        while not self._stop.wait(BEAT_SECONDS):
            try:
                if self._taken_over():  # the run stops at its next step (files.folder_lost)
                    return
                os.utime(self.path)
            except OSError:  # a file system hiccup: the next beat tries again
                continue

    def _taken_over(self):
        """Whether another run holds the claim now (read from the file: one small read). Once
        seen, train.log, the new owner's file now, gets no more lines from this run."""
        if self.lost is None:
            holder = read_claim(self.path)
            if holder is None or holder.get("token") != self.owner["token"]:
                self.lost = describe(holder) if holder else "another run (the claim is gone)"
                if self.holder:
                    stop_file_logging()
            else:
                self.confirmed = time.monotonic()
        return self.lost is not None

    def _line(self):
        return (
            f"this run no longer owns --output_dir {self.path.parent}: it was taken over by {self.lost} while this "
            f"run was stalled (its claim not renewed for over {STALE_SECONDS} s); stopped without writing there again"
        )

    def check(self):
        """The fence (files.fenced): None while the claim is this run's, else the line that
        stops the run."""
        try:
            if not self._taken_over():
                return None
        except OSError:  # unreadable for a moment: the write itself says what is wrong
            return None
        return self._line()

    def lost_line(self):
        """files.folder_lost, asked every step and before each line of train.log: what the
        heartbeat saw, without a read; but when it has not seen the claim as this run's for two
        beats (this process was stalled: stopped, paused, swapped out, and its heartbeat with
        it), read now: a run that wakes writes no line and takes no step before it knows."""
        if self.lost is None and time.monotonic() - self.confirmed > 2 * BEAT_SECONDS:
            return self.check()
        return None if self.lost is None else self._line()

    def release(self):
        """Let go of the folder (the run has ended); the claim of a run that took it over stays."""
        if self.path is None:
            return
        self._stop.set()
        fence(None)
        if not self.holder:
            return
        not_at_exit_now(self.release)
        try:
            holder = read_claim(self.path)
            if holder is not None and holder.get("token") == self.owner["token"]:
                self.path.unlink(missing_ok=True)
        except OSError as error:  # the folder is gone or unreachable: the next start takes a dead claim over
            log.warning("could not let go of %s: %s", self.path, error)


def this_process(job):
    return {
        "job": job,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_identity(),
        "process_start": process_start(os.getpid()),
        "token": uuid.uuid4().hex,
    }


def describe(owner):
    job = f", {owner['job']}" if owner.get("job") else ""
    return f"host {owner.get('host')}, pid {owner.get('pid')}, started {owner.get('started')}{job}"


NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _create(path, me):
    """Write `me` as the claim if there is none: a complete file linked to its name, which fails
    when the name exists (atomic on local and network file systems alike). On NFS the reply to a
    link that succeeded can be lost and the retry answer EEXIST: the claim is then read back,
    ours if it holds our token. A file system without hard links gets the file created only if
    absent (O_EXCL) and written: a reader may see it empty for a moment (read_claim)."""
    tmp = path.with_name(f".owner.{me['token']}.tmp")
    text = json.dumps(me) + "\n"
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return (read_claim(path) or {}).get("token") == me["token"]
    except OSError as error:
        if error.errno not in NO_HARD_LINKS:
            raise
        return _create_exclusive(path, text)
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path, text):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    return True


def read_claim(path):
    """The claim's owner (a dict), or None when there is no claim. A damaged claim file names no
    one; it is taken over as gone."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if not text:  # created, not yet written (a file system without hard links: _create_exclusive)
        return {"token": "being written", "written": False}
    try:
        owner = json.loads(text)
    except ValueError:
        owner = None
    return owner if isinstance(owner, dict) else {"token": f"damaged {text[:40]!r}"}


def _set_aside(path, owner):
    """Move a gone owner's claim out of the way; False when another start was first."""
    aside = path.with_name(f".owner.{uuid.uuid4().hex}.gone")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if read_claim(aside).get("token") != owner.get("token"):  # renewed or replaced since we read it
        _create(path, read_claim(aside))  # put it back (unless another start claimed meanwhile)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def why_gone(owner, path):
    """Why the owner of the claim at `path` is gone, or None while it lives."""
    if owner.get("written") is False:  # empty: being written, unless it stays so past the staleness
        age = claim_age(path)
        return None if age is None or age < STALE_SECONDS else "its claim file is empty"
    if "pid" not in owner:
        return "its claim file is damaged"
    if owner.get("machine") == machine_identity():
        return None if process_alive(owner) else f"its process {owner['pid']} no longer exists"
    age = claim_age(path)
    if age is None or age < STALE_SECONDS:
        return None
    # Old on the file system's clock: watched on this process's own clock before it is taken.
    seen = _stamp(path)
    for _ in range(WATCH_BEATS):
        time.sleep(BEAT_SECONDS)
        if _stamp(path) != seen:
            return None
    return f"its claim was not renewed for {age:.0f} s (every {BEAT_SECONDS} s while it runs)"


def claim_age(path):
    """Seconds since the claim was renewed, on the file system's own clock (a file written now
    beside it): the owner's host clock and this one's are never compared."""
    probe = path.with_name(f".owner.{uuid.uuid4().hex}.now")
    try:
        probe.write_text("")
        now = probe.stat().st_mtime
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def _stamp(path):
    try:
        with open(path, "rb") as file:  # opening revalidates a network file system's cached times
            return os.fstat(file.fileno()).st_mtime_ns
    except FileNotFoundError:
        return None


def machine_identity():
    """This machine's running kernel and process namespace: processes on the same one can be
    looked up by pid (a container has its own namespace, a reboot a new boot id)."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.endswith("/pid") else Path(source).read_text().strip())
        except OSError:
            parts.append("?")
    return " ".join(parts)


def process_alive(owner):
    """Whether the owner's process runs (on this machine): the same pid started at the same
    time, where /proc tells (Linux); elsewhere (macOS) whether the pid exists at all."""
    if owner.get("process_start") is not None:
        return process_start(owner["pid"]) == owner["process_start"]
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_start(pid):
    """When process `pid` started (clock ticks after boot), None if it does not exist or has
    exited (a zombie): with the pid, it names one process (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])
