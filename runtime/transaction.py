"""StepTransaction: the planners and the executor of a plan as one all-or-nothing unit.

The planners decide (the scheduler with its table tracker, when there is one; the manager);
the executor applies what they planned (a cache, or every tensor-parallel rank through
``Engine._execute``). One object opens, commits and undoes all of them and knows how far the
plan got, so no caller re-weaves the parts' transactions:

    IDLE -begin-> PLANNING -executed-> EXECUTED -commit-> RECORDED -> IDLE
                  |  commit: keep the plan (one phase: request endings, VMemCache growth)
                  |  rollback: planners as at begin; the tracker resent
                  EXECUTED: the plan's memory is kept; the planners are open again over
                     recording the step; rollback undoes the recording only
                  RECORDED: the commit point; rollback from here completes the commit

It lives above the scheduler and runtime/cache, the layers it joins. Each method may be
interrupted at any line (a KeyboardInterrupt) and called again: each part is closed only while
it is open, and every undo is idempotent, so a second ``rollback`` finishes the first.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, Optional, Tuple, TypeVar

from vmemkv.runtime.interrupts import deferred_interrupts
from vmemkv.scheduler.errors import TransactionStateError
from vmemkv.scheduler.plan import StepPlan

T = TypeVar("T")
Undo = Callable[[], None]


class Phase(Enum):
    IDLE = "idle"             # no transaction open
    PLANNING = "planning"     # planners open over planning and sending the plan
    EXECUTED = "executed"     # the plan's memory committed; planners open over its recording
    RECORDED = "recorded"     # past the commit point


class StepTransaction:
    """``manager``'s, ``scheduler``'s (optional) and their tracker's changes, and the plan
    ``execute`` applies, as one transaction (see the module docstring). ``begin`` costs the
    parts' own ``begin`` (the manager's is O(1)) and nothing else; ``tables`` defaults to the
    scheduler's tracker. ``undo`` callables given to ``begin``/``executed`` put back the
    caller's own state: run, in order, by a rollback of that phase (they must be idempotent)."""

    def __init__(self, manager, execute: Callable[[StepPlan], T], scheduler=None,
                 tables=None) -> None:
        self._planners = (manager,) if scheduler is None else (scheduler, manager)
        self._execute = execute
        self.scheduler = scheduler
        self.tables = tables if tables is not None or scheduler is None else scheduler.tables
        # (phase, the undo of that phase, EXECUTED: whether the planners' open transactions are
        # the recording's): one value, so an interrupt never splits a phase from its undo
        self._state: Tuple[Phase, Tuple[Undo, ...], bool] = (Phase.IDLE, (), False)

    @property
    def phase(self) -> Phase:
        return self._state[0]

    def begin(self, *undo: Undo) -> None:
        """Open the planners' transactions (PLANNING). TransactionStateError if one is open."""
        if self.phase is not Phase.IDLE:
            raise TransactionStateError(f"begin() in phase {self.phase.value}; commit or roll back first")
        self._state = (Phase.PLANNING, undo, False)
        self._open()

    def execute(self, plan: StepPlan) -> T:
        """Send ``plan`` to the executor (PLANNING); its result."""
        self._expect(Phase.PLANNING, "execute")
        return self._execute(plan)

    def run(self, make_plan: Callable[[], StepPlan], *undo: Undo) -> Tuple[StepPlan, T]:
        """begin, ``make_plan()`` (planner calls, returning their plan), execute, commit: all
        of it or none (any exception rolls back and propagates). Returns (plan, result). A
        Ctrl-C lands after the commit (``deferred_interrupts``): one between the executor's
        return and the commit rolled the planners back over memory the executor had changed. A
        caller with records to update after ``run`` holds Ctrl-C over both the same way."""
        with deferred_interrupts():
            self.begin(*undo)
            try:
                plan = make_plan()
                result = self._execute(plan)
            except BaseException:
                self.rollback()
                raise
            self.commit()
        return plan, result

    def executed(self, *undo: Undo) -> None:
        """The plan ran: its memory is kept from here on (the planners commit) and they open
        again over recording the step (EXECUTED); ``undo`` puts the caller's records back."""
        self._expect(Phase.PLANNING, "executed")
        self._state = (Phase.EXECUTED, (), False)
        self._close(keep=True)           # the plan's transactions
        self._state = (Phase.EXECUTED, undo, True)
        self._open()                     # the recording's

    def forget_step(self) -> None:
        """PLANNING, the plan's memory applied but its step not to be recorded (the model or
        the sampler raised): keep the memory, forget the step (the next plan computes the same
        tokens again)."""
        self._expect(Phase.PLANNING, "forget_step")
        self._state = (Phase.EXECUTED, (), False)
        self.rollback()                  # the plan's transactions kept, no recording open

    def commit(self) -> None:
        """Keep everything since ``begin`` (PLANNING: the plan; EXECUTED: its recording)."""
        if self.phase not in (Phase.PLANNING, Phase.EXECUTED):
            raise TransactionStateError(f"commit() in phase {self.phase.value}")
        self._state = (Phase.RECORDED, (), False)   # the commit point
        self._close(keep=True)
        self._end()

    def rollback(self) -> Phase:
        """Undo what is not committed, by phase; returns the phase it was in. PLANNING: every
        planner as at ``begin``, the tracker resent (the plan's edits did not reach the
        executor or were undone there), ``undo``. EXECUTED: the recording's changes and its
        ``undo`` (the plan's memory stays) and the scheduler forgets the step. RECORDED:
        completes the commit. IDLE: nothing."""
        phase, undos, recording = self._state
        if phase is Phase.PLANNING:
            self._close(keep=False)
            if self.tables is not None:
                self.tables.resend()
        elif phase is Phase.EXECUTED:
            self._close(keep=not recording)   # an interrupted executed(): finish it
            if self.scheduler is not None:
                self.scheduler.discard_step()
        else:
            self._close(keep=True)
        for undo in undos:
            undo()
        self._end()
        return phase

    def _open(self) -> None:
        for planner in self._planners:
            planner.begin()

    def _close(self, keep: bool) -> None:
        for planner in self._planners:
            if planner.in_transaction:
                planner.commit() if keep else planner.rollback()

    def _end(self) -> None:
        self._state = (Phase.IDLE, (), False)

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            raise TransactionStateError(f"{what}() in phase {self.phase.value}, "
                                        f"not {phase.value}")


def cache_executor(cache) -> Callable[[StepPlan], None]:
    """An executor for a lone cache (a ``KVCache``, or a ``KV``): the plan's ops, waited for
    (a background mapper's overlap is given up), then its table edits."""
    def execute(plan: StepPlan) -> None:
        cache.execute(plan.ops)
        cache.wait_for_plan()
        cache.apply_tables(plan.tables)
    return execute

