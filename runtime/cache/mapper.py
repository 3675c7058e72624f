"""BackgroundMapper: apply a plan's memory ops on a thread, one op group (layer) at a time.

    step thread:   submit(ops) ---- write(l=0) [wait g0] --- compute --- write(l=1) [wait g1] ...
    mapper thread:      apply g0 | apply g1 | apply g2 | ...

Within a group, ops run in plan order; groups touch disjoint memory (different layers), so the
plan's overall effect is the same as applying it inline. A new plan waits for the previous one
to finish (plans are ordered). The mapper never maps twice and never leaves a mapping half done:
each op is applied by exactly one thread, the mapper, in order. On an error the failure is
stored and re-raised (as MapperError) in the step thread at the next wait; when the apply
function has already undone the failed plan (it raised PlanExecutionError, as VMemKVCache's
does) the error is a MapperPlanError, which is both.

Shutdown: ``close()`` finishes the plan in flight and joins the thread; mappers still open at
interpreter exit are closed by one atexit hook (the thread is also a daemon, so a mapper whose
owner died in an exception never keeps the process alive). The thread holds the mapper only
while it applies a group, never while idle: a mapper dropped without ``close()`` (with its owner,
e.g. a VMemKVCache, whose ``apply`` it holds) is collected as it would be without a thread, and
the thread then ends (woken by a weakref callback that only signals it). A wait never returns
for a group that is not applied: one under way when ``close()`` comes waits for the plan to
finish; a plan submitted after ``close()`` is refused (MapperError), so nothing is written to
unmapped memory.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

from ..errors import MapperError, MapperPlanError, PlanExecutionError

_LIVE: "weakref.WeakSet[BackgroundMapper]" = weakref.WeakSet()
# An idle thread re-checks that its mapper lives this often: the backstop for a drop whose
# wake-up could not take the lock (_wake_on_drop never waits).
_IDLE_RECHECK_S = 1.0


def _wake_on_drop(cond: threading.Condition) -> Callable[[object], None]:
    """The callback of the thread's weak reference to its mapper: wake the thread so that it
    sees the mapper gone and ends. It may run on any thread, inside any operation (a garbage
    collection), so it only signals: it never waits for the lock nor changes the mapper's state
    (a signal it cannot send is caught by the thread's _IDLE_RECHECK_S timeout)."""
    def wake(_dead_ref: object) -> None:
        if cond.acquire(blocking=False):
            try:
                cond.notify_all()
            finally:
                cond.release()
    return wake


class DeferredUndo(Exception):
    """Raised by an apply function on the mapper thread: the plan failed and ``undo()`` (which
    returns the PlanExecutionError to raise) must run on the STEP thread, at its next wait. The
    step thread may be writing into pages of groups already applied; undoing them from the
    mapper thread would unmap memory under it (a segmentation fault on the host driver)."""

    def __init__(self, undo: Callable[[], BaseException], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.undo, self.cause = undo, cause


class BackgroundMapper:
    """``apply(plan, group)`` runs on one daemon thread for groups 0..num_groups-1 of each
    submitted plan. ``plan`` is whatever the owner submitted, handed over untouched
    (VMemKVCache submits its bound ops with their undo journal)."""

    def __init__(self, apply: Callable[[object, int], None], num_groups: int) -> None:
        self._apply = apply
        self._num_groups = num_groups
        self._cond = threading.Condition()
        self._pending: list | None = None     # the plan being applied (or queued)
        self._groups_done = num_groups         # groups of the current plan already applied
        self._error: BaseException | None = None
        self._stop = False                     # close() asked: finish the plan, then exit
        self._exited = False                   # the thread has left _run: nothing more applied
        self.wait_s = 0.0                # step thread blocked on the mapper
        self.busy_s = 0.0                # mapper thread applying ops
        self._thread = threading.Thread(  # a weak reference: the thread never keeps us alive
            target=BackgroundMapper._run, name="vmemkv-mapper", daemon=True,
            args=(weakref.ref(self, _wake_on_drop(self._cond)), self._cond))
        self._thread.start()
        _LIVE.add(self)

    def submit(self, plan) -> None:
        """Queue a plan (handed to ``apply`` as is, so the caller must not change it); returns
        as soon as the previous plan has been fully applied. MapperError after ``close()``
        (no thread would apply it), with the plan not taken."""
        self.wait_all()
        with self._cond:
            self._raise_if_failed()
            if self._stop:
                raise MapperError("plan submitted after the background mapper was closed; "
                                  "nothing of it was applied")
            self._pending = plan
            self._groups_done = 0
            self._cond.notify_all()

    def holds(self, plan) -> bool:
        """Whether ``plan`` was handed over (``submit`` set it; applying or undoing it is this
        thread's from then on)."""
        with self._cond:
            return plan is not None and self._pending is plan

    def wait_group(self, group: int) -> None:
        """Block until group ``group`` of the current plan is applied (also across ``close()``,
        which finishes the plan); MapperError if it failed or never will be applied."""
        self._wait(lambda: self._groups_done > group, f"group {group} of")

    def wait_all(self) -> None:
        """Block until the current plan is applied whole; MapperError as ``wait_group``."""
        self._wait(lambda: self._groups_done >= self._num_groups, "all groups of")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        with self._cond:
            if not ready() and self._error is None:
                start = time.perf_counter()
                self._cond.wait_for(lambda: ready() or self._error is not None or self._exited)
                self.wait_s += time.perf_counter() - start
            self._raise_if_failed()
            if not ready():   # never return as if mapped: the caller would write unmapped memory
                raise MapperError(f"the background mapper stopped before {what} the plan "
                                  f"({self._groups_done} of {self._num_groups} groups) was applied")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._groups_done = self._num_groups  # the failed plan is abandoned
            if isinstance(error, DeferredUndo):   # undo here, where no write can race it
                cause, error = error.cause, error.undo()
                error.__cause__ = cause
            if isinstance(error, PlanExecutionError):
                raise MapperPlanError(f"background mapping failed: {error}",
                                      op_index=error.op_index,
                                      rolled_back=error.rolled_back) from error
            raise MapperError(f"background mapping failed: {error}") from error

    @staticmethod
    def _run(mapper_ref: "weakref.ref[BackgroundMapper]", cond: threading.Condition) -> None:
        """The thread's loop. It holds the mapper (and so its owner) only while it applies a
        group: when the mapper is dropped without ``close()`` it returns."""
        while True:
            with cond:
                mapper = mapper_ref()
                if mapper is None:
                    return
                if mapper._groups_done >= mapper._num_groups:   # nothing to apply
                    if mapper._stop:
                        mapper._exited = True
                        cond.notify_all()
                        return
                    del mapper      # idle: hold nothing, so a dropped mapper can be collected
                    if mapper_ref() is not None:   # (it may have died just now, on this thread)
                        cond.wait(_IDLE_RECHECK_S)  # woken by submit, close or _wake_on_drop
                    continue
                plan, group = mapper._pending, mapper._groups_done
            mapper._apply_group(plan, group)
            del mapper, plan

    def _apply_group(self, plan, group: int) -> None:
        """Apply one group on the mapper thread; a failure is kept for the step thread."""
        start = time.perf_counter()
        try:
            self._apply(plan, group)
        except BaseException as error:  # handed to the step thread
            with self._cond:
                self._error = error
                self._groups_done = self._num_groups
                self._cond.notify_all()
            return
        finally:
            self.busy_s += time.perf_counter() - start
        with self._cond:
            self._groups_done = group + 1
            self._cond.notify_all()

    def close(self) -> None:
        """Finish the plan in flight, then stop the thread; a later ``submit`` raises
        MapperError. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        _LIVE.discard(self)

    def on_thread(self) -> bool:
        """Whether the caller runs on the mapper thread."""
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@atexit.register
def _close_at_exit() -> None:
    for mapper in list(_LIVE):
        mapper.close()
