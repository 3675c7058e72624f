"""Checking available memory and committing pages as one step, process-wide.

Two pools created at once (two threads) both read the same free memory, both passed the check
and together committed more than there was. And on Linux MemAvailable lags a large memfd
commit (a 320 MiB fallocate here showed 234 MiB at once and the rest over about 1.5 s), so a
pool created right after another passed against memory the first had already taken. So:

    LOCK            one lock in the process, held over each reading of the available memory,
                    the check, and the commit it allows (``Driver.commit``)
    RecentCommits   per memory (the host's, one GPU's): what this process committed in the
                    last ``window_s`` seconds that the reading may not show yet, subtracted
                    from the reading before each check: those bytes less what the reading has
                    dropped by since the first of them, and less what was given back since

It errs towards refusing: memory another process frees in those seconds hides as much of ours
from the drop, so for a few seconds at most a pool may be refused that would just have fit.

``Deferred``: what a tensor's deleter must do under a lock it may never wait for
(``RecentCommits.released`` under ``LOCK``), run now when the lock is free, else by the holder's
next call. ``DrainingLock``: a pool's lock (vmem/pool.py), whose queue (a view's count,
vmem/vrange.py) runs as each thread's outermost call under it returns, so no call of the pool
or its ranges ever sees a count a dead view left stale.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional

LOCK = threading.Lock()
WINDOW_S = 5.0      # a few times the lag measured (module docstring)


class Deferred:
    """Work a thread that must never wait hands in (a tensor's deleter; the collector can run
    one on any thread, inside any call, holding any lock) that has to run under ``lock``: run
    at once when ``lock`` is free (or held by this thread), else queued and run by the next
    ``drain``, which the lock's holders call under it. Waiting instead deadlocked the process:
    the holder could be waiting for a lock the deleter's thread holds."""

    def __init__(self, run: Callable[[Any], None]) -> None:
        self._run = run
        self._queue: List[Any] = []

    def submit(self, item: Any, lock) -> None:
        """``run(item)`` now under ``lock`` if it is free, else queued; never waits, never
        raises what ``run`` raises later in a drain."""
        self.queue(item)
        if lock.acquire(blocking=False):
            try:
                self.drain()
            finally:
                lock.release()

    def queue(self, item: Any) -> None:
        """Add ``item`` to run at the next ``drain``; never waits (one atomic append)."""
        self._queue.append(item)

    def drain(self) -> None:
        """Run every queued item, oldest first; the caller holds the lock."""
        while True:
            try:               # a collection inside run() may drain too (same thread)
                item = self._queue.pop(0)
            except IndexError:
                return
            self._run(item)

    @property
    def pending(self) -> int:
        """Items queued and not run yet."""
        return len(self._queue)


class DrainingLock:
    """A re-entrant lock (``with``) with a queue of work a thread that must never wait hands
    in (``submit``: a view's deleter, vmem/vrange.py). The work runs under the lock, never in
    the middle of a call holding it (a collection inside a call on its thread would change
    what the call had just read): at once when the lock is free, else as the holder's
    outermost ``with`` ends, else at the next one's start. Each outermost exit drains again
    after letting the lock go (work queued while it held it), so nothing waits in the queue
    while no thread holds the lock (``forks`` takes ``lock`` itself: drained at the next
    call)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._work = Deferred(lambda work: work())
        self._depth = 0          # the holder's nested ``with``s (written by the holder only)

    def __enter__(self) -> "DrainingLock":
        self.lock.acquire()
        self._depth += 1
        if self._depth == 1:
            try:
                self._work.drain()
            except BaseException:
                self._depth -= 1
                self.lock.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        outermost = not self._depth
        self.lock.release()
        if outermost:
            self._drain_pending()

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work()`` under the lock, now or when its holder's call returns; never waits."""
        self._work.queue(work)
        self._drain_pending()

    def _drain_pending(self) -> None:
        """Run the queue under the lock if it is free and this thread is in no call under it
        (else the call drains as it ends; another thread's, or the next call). Never waits."""
        while self._work.pending and self.lock.acquire(blocking=False):
            try:
                if self._depth:          # held by this thread's own call
                    return
                self._depth = 1
                try:
                    self._work.drain()
                finally:
                    self._depth = 0
            finally:
                self.lock.release()


class RecentCommits:
    """Bytes committed on one memory in the last ``window_s`` seconds (by ``clock``, seconds)
    that its available-memory reading may not show yet. ``unseen`` and ``committed`` are
    called under ``LOCK``; ``released`` takes it when it is free, and never waits for it."""

    def __init__(self, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._commits: List[list] = []          # [when, bytes], oldest first
        self._before: Optional[int] = None      # the reading before the oldest of them
        self._given_back = Deferred(self._forget)   # bytes released while LOCK was held

    def unseen(self, available: int) -> int:
        """Bytes of the recent commits that ``available`` (read now) does not show yet."""
        self._given_back.drain()
        now = self._clock()
        self._commits = [c for c in self._commits if now - c[0] <= self.window_s]
        pending = sum(num_bytes for _, num_bytes in self._commits)
        left = pending - max(0, self._before - available) if self._commits else 0
        if left <= 0:       # the reading shows them all: forget them
            self._commits, self._before = [], None
        return max(0, left)

    def committed(self, num_bytes: int, available_before: int) -> None:
        """``num_bytes`` were committed just now; ``available_before`` was read before it."""
        if not self._commits:
            self._before = available_before
        self._commits.append([self._clock(), num_bytes])

    def released(self, num_bytes: int) -> None:
        """``num_bytes`` were given back: they no longer count, newest commits first. Never
        waits for ``LOCK``: a view's deleter calls this (vmem/vrange.py), and the collector can
        run one inside a commit on the same thread (reading MemAvailable allocates), where
        waiting deadlocked the process. When ``LOCK`` is held the bytes are queued and
        forgotten at the next reading (until then a check errs towards refusing)."""
        self._given_back.submit(num_bytes, LOCK)

    def _forget(self, num_bytes: int) -> None:
        while num_bytes > 0 and self._commits:
            taken = min(num_bytes, self._commits[-1][1])
            self._commits[-1][1] -= taken
            num_bytes -= taken
            if not self._commits[-1][1]:
                self._commits.pop()


HOST = RecentCommits()                           # every HostDriver's: one host memory
_devices: Dict[str, RecentCommits] = {}


def of_device(device: str) -> RecentCommits:
    """The one ledger of ``device`` ("cuda:0") in this process."""
    with LOCK:
        return _devices.setdefault(device, RecentCommits())


def _after_fork_in_child() -> None:
    """vmem/forks.py: a lock another thread held at the fork would stay held in the child."""
    global LOCK
    LOCK = threading.Lock()
