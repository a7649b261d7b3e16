"""Waits through the key-value store, for waits that the collective timeout must not bound
(a large checkpoint on a slow file system): `store_barrier`, `agree` and `share_from_main`.

They wait in slices and watch every rank's heartbeat in the store (`Heartbeats`, started by
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
GONE_SECONDS = 6.0  # a rank whose counter has not moved for this long, as a waiting rank sees it, is gone
WAIT_SLICE_SECONDS = 1.0  # a rank waiting in the store looks at the heartbeats this often


class Heartbeats:
    """Every rank's heartbeat in the store: a counter its own thread raises every BEAT_SECONDS,
    through a clone of the store (a client of its own: a wait on the main thread does not hold
    it up), whatever the rank is doing (torch.save and DCP's writes let the thread run). A rank
    waiting in the store asks `gone()`: the ranks whose counter has not moved for GONE_SECONDS
    on its own clock (no two hosts' clocks are compared). The thread also ends the process when
    another rank has stopped the job alone and said why (faults.FAILED_KEY, set by a rank out of
    memory), wherever this one waits for it."""

    def __init__(self, store, rank, world_size):
        self.store, self.rank = store, rank
        self.keys = [f"heartbeat/{other}" for other in range(world_size)]
        self.seen = {}  # rank: (its counter, when this rank saw it change)
        self._stop = threading.Event()
        store.set(self.keys[rank], "0")
        threading.Thread(target=self._beat, args=(store.clone(),), name="heartbeat", daemon=True).start()

    def _beat(self, store):
        count = 0
        while not self._stop.wait(BEAT_SECONDS):
            count += 1
            try:
                store.set(self.keys[self.rank], str(count))
                failed = store.check([FAILED_KEY])
            except Exception:  # the store is gone: the job is ending
                return
            if failed:  # another rank stopped the job, and said why (errors.OutOfMemory): leave now
                exit_now(1)

    def gone(self):
        """The other ranks whose heartbeat has stopped (checked from a waiting rank)."""
        now = time.monotonic()
        others = [rank for rank in range(len(self.keys)) if rank != self.rank]
        keys = [self.keys[rank] for rank in others]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # a rank that has not started its heartbeat yet counts from now
            values = [self.store.get(key) if self.store.check([key]) else b"" for key in keys]
        stopped = []
        for rank, value in zip(others, values, strict=True):
            last = self.seen.get(rank)
            if last is None or last[0] != value:
                self.seen[rank] = (value, now)
            elif now - last[1] > GONE_SECONDS:
                stopped.append(rank)
        return stopped

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
