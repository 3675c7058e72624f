"""StepTransaction against a shadow: planners (a scheduler with its tracker, a manager) that
record values, an executor that applies a plan's ops all or nothing and fails at a chosen op.
Whatever the sequence of begin / planner calls / execute / executed / commit / rollback, the
planners hold exactly what the shadow says was committed, the executor's memory what ran, and
the tracker is resent exactly when a planning phase rolls back. An interrupt at every line of
``commit``, ``rollback``, ``executed`` and ``forget_step``, followed by one ``rollback``, leaves
the state of "committed" or of "rolled back", never a mix."""
from __future__ import annotations

import sys

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vmemkv.runtime.transaction as transaction
from vmemkv.runtime.transaction import Phase, StepTransaction
from vmemkv.scheduler.errors import TransactionStateError
from vmemkv.scheduler.plan import StepPlan


class Planner:
    """A planner over a list of values: begin/commit/rollback/in_transaction."""

    def __init__(self) -> None:
        self.values, self._saved = [], None

    def begin(self) -> None:
        assert self._saved is None, "nested begin"
        self._saved = list(self.values)

    @property
    def in_transaction(self) -> bool:
        return self._saved is not None

    def commit(self) -> None:
        assert self._saved is not None
        self._saved = None

    def rollback(self) -> None:
        saved, self._saved = self._saved, None
        self.values = saved


class Scheduler(Planner):
    def __init__(self, tables) -> None:
        super().__init__()
        self.tables, self.discards = tables, 0

    def discard_step(self) -> None:
        self.discards += 1


class Tracker:
    def __init__(self) -> None:
        self.resends = 0

    def resend(self) -> None:
        self.resends += 1


class Failed(Exception):
    pass


class Executor:
    """Applies ops to ``memory`` all or nothing; fails at op ``fail_at`` (None: never)."""

    def __init__(self) -> None:
        self.memory, self.fail_at = [], None

    def __call__(self, plan: StepPlan) -> int:
        if self.fail_at is not None and self.fail_at < len(plan.ops):
            raise Failed(self.fail_at)
        self.memory.extend(plan.ops)
        return len(plan.ops)


def parts():
    tracker = Tracker()
    scheduler, manager, executor = Scheduler(tracker), Planner(), Executor()
    return StepTransaction(manager, executor, scheduler=scheduler), scheduler, manager, executor


class TransactionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.txn, self.scheduler, self.manager, self.executor = parts()
        self.undone = []                   # the caller's undo calls, by phase
        self.shadow = ([], [], [])         # committed: scheduler, manager values; memory
        self.base = self.shadow            # planners at the phase's begin
        self.ops, self.resends, self.discards = [], 0, 0
        self.next = 0

    def _now(self):
        return (list(self.scheduler.values), list(self.manager.values), list(self.executor.memory))

    @precondition(lambda self: self.txn.phase is Phase.IDLE)
    @rule()
    def begin(self):
        self.txn.begin(lambda: self.undone.append("planning"))
        self.base, self.ops = self._now(), []

    @precondition(lambda self: self.txn.phase in (Phase.PLANNING, Phase.EXECUTED))
    @rule(to_scheduler=st.booleans())
    def plan_call(self, to_scheduler):
        self.next += 1
        (self.scheduler if to_scheduler else self.manager).values.append(self.next)
        if self.txn.phase is Phase.PLANNING:
            self.ops.append(self.next)

    @precondition(lambda self: self.txn.phase is Phase.PLANNING)
    @rule(fail_at=st.none() | st.integers(0, 3))
    def execute(self, fail_at):
        self.executor.fail_at = fail_at
        try:
            assert self.txn.execute(StepPlan([], list(self.ops))) == len(self.ops)
        except Failed:
            assert fail_at < len(self.ops)
            self.rollback()
            return
        self.txn.executed(lambda: self.undone.append("executed"))
        self.base = self._now()            # the plan is committed
        self.shadow = self.base

    @precondition(lambda self: self.txn.phase in (Phase.PLANNING, Phase.EXECUTED))
    @rule()
    def commit(self):
        if self.txn.phase is Phase.PLANNING:   # one phase: the plan is kept and executed
            self.executor.memory.extend(self.ops)
        self.txn.commit()
        self.shadow = self._now()

    @precondition(lambda self: self.txn.phase in (Phase.PLANNING, Phase.EXECUTED))
    @rule()
    def rollback(self):
        phase = self.txn.phase
        assert self.txn.rollback() is phase
        self.undone, undone = [], self.undone
        assert undone == [phase.value]
        self.resends += phase is Phase.PLANNING
        self.discards += phase is Phase.EXECUTED
        assert self._now() == self.base

    @invariant()
    def matches_the_shadow(self):
        assert self.scheduler.tables.resends == self.resends
        assert self.scheduler.discards == self.discards
        if self.txn.phase is Phase.IDLE:
            assert self._now() == self.shadow
            assert not self.scheduler.in_transaction and not self.manager.in_transaction
        else:
            assert self.scheduler.in_transaction and self.manager.in_transaction
            assert self.executor.memory == self.shadow[2]


TransactionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                                deadline=None)
test_step_transaction_matches_its_shadow = TransactionMachine.TestCase


def test_out_of_order_calls_are_refused_and_change_nothing():
    txn, scheduler, manager, _ = parts()
    for call in (txn.commit, txn.executed, txn.forget_step, lambda: txn.execute(StepPlan([], []))):
        with pytest.raises(TransactionStateError):
            call()
    txn.begin()
    with pytest.raises(TransactionStateError, match="begin"):
        txn.begin()
    assert txn.phase is Phase.PLANNING and scheduler.in_transaction and manager.in_transaction


def test_a_failed_one_phase_run_undoes_planners_and_the_callers_state():
    txn, scheduler, manager, executor = parts()
    executor.fail_at, undone = 0, []

    def make_plan():
        scheduler.values.append(1)
        manager.values.append(2)
        return StepPlan([], [2])

    with pytest.raises(Failed):
        txn.run(make_plan, lambda: undone.append(1))
    assert (scheduler.values, manager.values, executor.memory, undone) == ([], [], [], [1])
    assert scheduler.tables.resends == 1 and txn.phase is Phase.IDLE
    executor.fail_at = None
    assert txn.run(make_plan)[1] == 1
    assert (scheduler.values, manager.values, executor.memory) == ([1], [2], [2])



def test_an_interrupted_one_phase_run_is_undone_as_a_failed_one():
    """``run`` is all or nothing for any exception: a KeyboardInterrupt while the plan is made
    rolls the planners and the caller's state back and leaves no transaction open."""
    txn, scheduler, manager, executor = parts()
    undone = []

    def make_plan():
        scheduler.values.append(1)
        manager.values.append(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        txn.run(make_plan, lambda: undone.append(1))
    assert (scheduler.values, manager.values, executor.memory, undone) == ([], [], [], [1])
    assert txn.phase is Phase.IDLE and not scheduler.in_transaction and not manager.in_transaction

class LineInterrupter:
    """KeyboardInterrupt at the k-th line event of ``function`` in runtime/transaction.py."""

    def __init__(self, function: str, k: int) -> None:
        self.function, self.left, self.fired = function, k, False

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != transaction.__file__:
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and frame.f_code.co_name == self.function and self.left:
            self.left -= 1
            if not self.left:
                self.fired = True
                raise KeyboardInterrupt
        return self._line

    def __enter__(self):
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return exc[0] is KeyboardInterrupt


def staged(upto: str):
    """A transaction brought to the phase ``upto`` runs in, with a change in each planner."""
    txn, scheduler, manager, executor = parts()
    undone = set()                     # the undos are idempotent: a set records them
    txn.begin(lambda: undone.add("planning"))
    scheduler.values.append(1)
    manager.values.append(1)
    if upto in ("commit-recording", "rollback-recording"):
        txn.execute(StepPlan([], [1]))
        txn.executed(lambda: undone.add("executed"))
        scheduler.values.append(2)
        manager.values.append(2)
    return txn, scheduler, manager, executor, undone


# (what is interrupted, the call, the values both planners end with if it completes or is
# undone, and the caller's undo calls each way)
CASES = [
    ("commit-plan", "commit", {(1,): set(), (): {"planning"}}),
    ("rollback-plan", "rollback", {(): {"planning"}}),
    ("commit-recording", "commit", {(1, 2): set(), (1,): {"executed"}}),
    ("rollback-recording", "rollback", {(1,): {"executed"}}),
    ("executed", "executed", {(1,): set(), (): {"planning"}}),
    ("forget_step", "forget_step", {(1,): set(), (): {"planning"}}),   # () if still planning
]


@pytest.mark.parametrize("upto, call, outcomes", CASES, ids=[c[0] for c in CASES])
def test_an_interrupt_at_every_line_then_rollback_leaves_one_whole_outcome(upto, call, outcomes):
    """Interrupt the k-th line of the call for every k, then ``rollback()`` as the engine's
    handler does: both planners agree, hold one of the allowed outcomes, nothing stays open."""
    k, seen = 1, set()
    while True:
        txn, scheduler, manager, executor, undone = staged(upto)
        with LineInterrupter(call, k) as interrupter:
            if call == "executed":
                txn.execute(StepPlan([], [1]))
                txn.executed()
            elif call == "forget_step":
                txn.forget_step()
            else:
                getattr(txn, call)()
        if interrupter.fired:
            txn.rollback()          # the handler: finish or undo what was interrupted
        values = tuple(manager.values)
        assert tuple(scheduler.values) == values and values in outcomes, (call, k)
        if upto.startswith("rollback") or call == "forget_step" or interrupter.fired:
            assert undone == outcomes[values], (call, k)
        assert txn.phase is Phase.IDLE or (call == "executed" and not interrupter.fired)
        assert not (txn.phase is Phase.IDLE and (scheduler.in_transaction or manager.in_transaction))
        seen.add(values)
        if not interrupter.fired:
            break
        k += 1
    assert k > 3   # the sweep reached the call's body
