"""The undo journal stays exact when an exception stops a journaled change half-way (a
KeyboardInterrupt can strike at any line): every mutator of the journaled containers is
interrupted at each of its lines in turn, then the transaction is rolled back, and the
container is exactly as at ``begin`` (order included, but a JDict's, which keeps none)."""
from __future__ import annotations

import sys

import pytest

import vmemkv.scheduler.managers.journal as journal
from vmemkv.scheduler.managers.journal import JDict, JList, JSet, OrderedUnits, TxnCell


def contents(container):
    """What a rollback must restore: the items, in order (a JDict keeps no order across one)."""
    if isinstance(container, OrderedUnits):
        return list(container), len(container)
    if isinstance(container, dict):
        return dict(container)
    return list(container)


def build(kind: str, cell: TxnCell):
    if kind == "list":
        return JList(cell, [1, 2, 3])
    if kind == "dict":
        return JDict(cell, {1: "a", 2: "b"})
    if kind == "set":
        return JSet(cell, {1, 2})
    units = OrderedUnits(cell, range(70))   # past the compaction threshold once keys go
    for key in range(0, 60, 2):
        units.remove(key)
    return units


CHANGES = {
    "list": [lambda c: c.append(4), lambda c: c.pop(), lambda c: c.__setitem__(0, 9)],
    "dict": [lambda c: c.__setitem__(3, "c"), lambda c: c.__setitem__(1, "z"),
             lambda c: c.__delitem__(2), lambda c: c.pop(1)],
    "set": [lambda c: c.add(3), lambda c: c.discard(1), lambda c: c.remove(2), lambda c: c.clear()],
    "units": [lambda c: c.add(100), lambda c: c.remove(61), lambda c: c.pop_first()],
}


class LineInterrupt:
    """KeyboardInterrupt at the k-th line run inside journal.py (inside ``FILES``)."""

    FILES = (journal.__file__,)

    def __init__(self, k: int) -> None:
        self.left, self.fired = k, False

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.FILES else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if not self.left:
                self.fired = True
                raise KeyboardInterrupt
        return self._line


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_a_change_interrupted_at_any_line_rolls_back_exactly(kind):
    for index, change in enumerate(CHANGES[kind]):
        for k in range(1, 10**4):
            cell = TxnCell()
            container = build(kind, cell)
            before = contents(container)
            cell.open({})
            interrupt = LineInterrupt(k)
            sys.settrace(interrupt)
            try:
                change(container)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            cell.rollback([], [])
            assert contents(container) == before, f"{kind} change {index}, interrupted at line {k}"
            if not interrupt.fired:
                break
        assert k > 1   # each change ran at least one line of the journal
