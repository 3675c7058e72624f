"""PlanJournal: the undo log of one partly applied plan (every cache kind writes one)."""
from __future__ import annotations

from typing import Callable, Optional


class PlanJournal:
    """Undo actions for the part of one plan applied so far, run newest first on failure.

    Every primitive a cache applies (map, unmap, a copy that overwrites bytes) records its
    inverse right after it succeeds, so undoing in reverse order walks memory back through the
    exact states it went through; the swap space is restored from the copy taken when the plan
    was bound.
    """

    def __init__(self, swapped_before: dict) -> None:
        self.swapped_before = swapped_before
        self.replica_undo: list = []           # undo of the cache's replica, run on failure
        self.op_index: Optional[int] = None    # index in the plan of the op being applied
        self._undo: list = []

    def add(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def __len__(self) -> int:
        return len(self._undo)

    def undo(self) -> Optional[BaseException]:
        """Run every undo action, newest first; returns the first error an action raised (the
        remaining actions still run), None when memory is fully back."""
        first = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as error:  # keep undoing what can be undone
                first = first or error
        return first
