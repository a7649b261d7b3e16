"""Waits through the key-value store, for waits that the collective timeout must not bound
(a large checkpoint on a slow file system): `store_barrier`, `agree` and `share_from_main`.

They wait in slices and watch the ranks' heartbeats in the store (`Heartbeats`, started by
`dist.setup_distributed`): a rank that died (a SIGKILL, a lost node) stops the waiting ranks
within seconds, so torchrun's restart starts then, not when the wait's limit or torchrun's kill
after its stop signal comes.
"""

import collections
import json
import threading
import time

from ..errors import CheckpointError, RankGone, TrainingError
from .faults import FAILED_KEY, exit_now

BEAT_SECONDS = 1.0  # each rank raises its heartbeat counter in the store this often
GONE_SECONDS = 6.0  # a rank whose counter has not moved for this long, as its watcher sees it, is gone
WAIT_SLICE_SECONDS = 1.0  # a rank waiting in the store looks at the heartbeats this often
VERDICT_KEY = "heartbeat/verdict"  # rank 0's: "<its own counter> <the ranks it found gone, comma-separated>"


class Stillness:
    """How long each watched value has stood still, on the watcher's own running time: a look
    counts the time since the watcher's previous look, but never more than two of its periods.
    A longer gap means the watcher itself was not running (the whole job suspended by its
    scheduler, a frozen cgroup, a paused VM, a starved thread): the others were most likely
    stopped too, and a watcher resumed first must not take them for dead."""

    def __init__(self):
        self.values = {}  # name: (value, seconds it has stood still, when it was last looked at)

    def look(self, name, value, now):
        """Seconds `value` of `name` has stood still (0 when it moved since the last look)."""
        last = self.values.get(name)
        still = 0.0
        if last is not None and last[0] == value:
            still = last[1] + min(now - last[2], 2 * max(BEAT_SECONDS, WAIT_SLICE_SECONDS))
        self.values[name] = (value, still, now)
        return still


class Heartbeats:
    """The ranks' heartbeats in the store, at a cost that grows as the number of ranks.

    Each rank's thread raises its counter (`heartbeat/<rank>`) every BEAT_SECONDS, through a
    client of its own (a wait on the main thread does not hold it up), whatever the rank is
    doing (torch.save and DCP's writes let the thread run). Rank 0's thread is the watcher:
    each beat it reads every counter in one request and writes its verdict, one key
    (VERDICT_KEY): its own counter and the ranks whose counter has not moved for GONE_SECONDS.
    A rank waiting in the store asks `gone()`: it reads that one key, and takes rank 0 for gone
    when the verdict's counter has not moved for GONE_SECONDS. So the store serves about two
    requests per rank each second, waiting or not, not one read of every counter by every
    waiting rank. Stillness is counted on the watcher's own running time (`Stillness`), and
    no two hosts' clocks are compared. An error from the store (a connection reset, a busy
    server's timeout) costs one beat: the thread tries again, on a new connection, at the
    next. The thread also ends the process when another rank has stopped the job alone and said
    why (faults.FAILED_KEY, set by a rank out of memory), wherever this one waits for it."""

    def __init__(self, store, rank, world_size):
        self.store, self.rank = store, rank
        self.watched = [f"heartbeat/{other}" for other in range(1, world_size)]  # rank 0's verdict says for itself
        self.verdict = ()  # rank 0: the ranks its watcher found gone at its last beat
        self.stillness = Stillness()  # a waiting rank's view of the verdict's counter
        self.verdict_seen = False
        self._stop = threading.Event()
        if rank == 0:  # every key the watcher reads exists from now on (a rank's own beats may come first)
            store.multi_set([VERDICT_KEY, *self.watched], ["0 ", *["0"] * len(self.watched)])
        threading.Thread(target=self._beat, args=(store.clone(),), name="heartbeat", daemon=True).start()

    def _beat(self, store):
        count, stillness = 0, Stillness()
        while not self._stop.wait(BEAT_SECONDS):
            count += 1
            try:
                if store is None:
                    store = self.store.clone()
                if self.rank == 0:
                    values = store.multi_get(self.watched)
                    now = time.monotonic()
                    self.verdict = tuple(
                        rank for rank, value in enumerate(values, 1) if stillness.look(rank, value, now) > GONE_SECONDS
                    )
                    store.set(VERDICT_KEY, f"{count} {','.join(map(str, self.verdict))}")
                else:
                    store.set(self.watched[self.rank - 1], str(count))
                failed = store.check([FAILED_KEY])
            except Exception:  # the store did not answer this time: the next beat tries again, on a new client
                store = None
                continue
            if failed:  # another rank stopped the job, and said why (errors.OutOfMemory): leave now
                exit_now(1)

    def gone(self):
        """The other ranks whose heartbeat has stopped (checked from a waiting rank)."""
        if self.rank == 0:
            return list(self.verdict)
        if not self.verdict_seen:  # rank 0 has not started its heartbeat yet: its verdict counts from now
            self.verdict_seen = self.store.check([VERDICT_KEY])
        value = self.store.get(VERDICT_KEY).decode() if self.verdict_seen else ""
        count, _, found = value.partition(" ")
        if self.stillness.look(0, count, time.monotonic()) > GONE_SECONDS:
            return [0]
        return [rank for rank in map(int, filter(None, found.split(","))) if rank != self.rank]

    def stop(self):
        self._stop.set()


_heartbeats = None  # this process's (setup_distributed, with more than one rank)


def start_heartbeats(store, rank, world_size):
    global _heartbeats
    _heartbeats = Heartbeats(store, rank, world_size)


def stop_heartbeats():
    global _heartbeats
    if _heartbeats is not None:
        _heartbeats.stop()
        _heartbeats = None


def wait_in_store(ctx, keys, timeout_seconds, timed_out):
    """Wait until `keys` are set in the store, looking every few milliseconds at first, then
    every quarter second; every WAIT_SLICE_SECONDS a rank whose heartbeat stopped raises
    RankGone, and past `timeout_seconds`, `timed_out()` is raised. (Not the store's own wait in
    short slices: c10d logs two warnings each time one ends without the keys.)"""
    deadline = time.monotonic() + timeout_seconds
    pause, watched = 0.001, time.monotonic()
    while not ctx.store.check(keys):
        now = time.monotonic()
        if now >= deadline:
            raise timed_out()
        if _heartbeats is not None and now - watched >= WAIT_SLICE_SECONDS:
            watched, gone = now, _heartbeats.gone()
            if gone:
                raise RankGone(
                    f"rank {ctx.rank}: rank {', '.join(map(str, gone))} stopped answering (no heartbeat in the store "
                    f"for {GONE_SECONDS:.0f} s) while this rank waited for it; exiting so that the launcher restarts "
                    "the job"
                )
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, WAIT_SLICE_SECONDS / 4)


_barrier_uses = collections.Counter()  # per name: each use waits for its own arrivals


def store_barrier(ctx, name, error=None, timeout_seconds=1800, knob="--checkpoint_timeout_seconds"):
    """Wait until every rank has arrived at `name`, up to `timeout_seconds`, through the store.

    For waits that collectives must not bound: while rank 0 writes a large checkpoint to a slow
    file system, the other ranks wait here rather than in a collective limited by
    --timeout_seconds. Each rank may report an error; returns one of those reported, or None.
    Every rank must call it with the same names in the same order (a name used again is a new
    barrier); `knob` is the flag that sets the limit, for the error message.
    """
    _barrier_uses[name] += 1
    key = f"barrier/{name}/{_barrier_uses[name]}"
    if error:
        ctx.store.set(f"{key}/error", error)
    if ctx.store.add(f"{key}/arrived", 1) == ctx.world_size:
        ctx.store.set(f"{key}/all", "1")
    wait_in_store(ctx, [f"{key}/all"], timeout_seconds, lambda: CheckpointError(
        f"rank {ctx.rank} waited more than {timeout_seconds} s for the other ranks at {name}; raise {knob} if "
        "they are slow, not stuck"
    ))  # fmt: skip
    if ctx.store.check([f"{key}/error"]):
        return ctx.store.get(f"{key}/error").decode()
    return None


def agree(ctx, name, problem, timeout_seconds, error=TrainingError):
    """Stop every rank with `problem` (None: no problem) if any rank has one: all ranks call
    this, and every rank raises `error(problem)`, reported once, before anyone waits in a
    collective."""
    problem = store_barrier(ctx, name, problem, timeout_seconds, "--timeout_seconds")
    if problem:
        raise error(problem)


def share_from_main(ctx, name, value, timeout_seconds):
    """Rank 0's `value` (JSON data) on every rank, sent through the store: the others wait for
    it up to `timeout_seconds`, as in `store_barrier`."""
    key = f"shared/{name}"
    if ctx.is_main:
        ctx.store.set(key, json.dumps(value))
    else:
        wait_in_store(ctx, [key], timeout_seconds, lambda: CheckpointError(
            f"rank {ctx.rank} waited more than {timeout_seconds} s for rank 0 at {name}; raise "
            "--checkpoint_timeout_seconds if the file system is slow"
        ))  # fmt: skip
    return json.loads(ctx.store.get(key))
