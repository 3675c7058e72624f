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
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

LOCK = threading.Lock()
WINDOW_S = 5.0      # a few times the lag measured (module docstring)


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
        self._given_back: List[int] = []        # released while LOCK was held: forgotten next

    def unseen(self, available: int) -> int:
        """Bytes of the recent commits that ``available`` (read now) does not show yet."""
        self._forget_given_back()
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
        self._given_back.append(num_bytes)      # one atomic append, whoever holds the lock
        if LOCK.acquire(blocking=False):
            try:
                self._forget_given_back()
            finally:
                LOCK.release()

    def _forget_given_back(self) -> None:
        while self._given_back:
            self._forget(self._given_back.pop())

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
