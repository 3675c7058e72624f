"""Free vmem slots bucketed by how many pages they still have mapped, so that placing a new
sequence on "the free slot with the most pages already mapped" is O(pages_per_slot), not
O(num_slots). Every change logs to the manager's open journal (journal.py)."""
from __future__ import annotations

from typing import Optional

from .journal import JDict, OrderedUnits, TxnCell, journaled


class FreeSlots:
    """Set of free slots, each filed under its count of mapped pages (0..pages_per_slot).

    Guarantees: ``pick()`` returns a free slot with the maximal count (the earliest filed of
    those); a count change of a free slot must be reported with ``recount``.
    """

    def __init__(self, num_slots: int, pages_per_slot: int,
                 cell: Optional[TxnCell] = None) -> None:
        cell = TxnCell() if cell is None else cell
        self._buckets = (OrderedUnits(cell, range(num_slots)),) + tuple(      # count -> slots
            OrderedUnits(cell) for _ in range(pages_per_slot))
        self._count = JDict(cell, {s: 0 for s in range(num_slots)})    # free slot -> its count

    def journaled_fields(self) -> bool:
        """Every field is undone by a rollback (journal.journaled)."""
        return all(journaled(v) for v in vars(self).values())

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, slot: int) -> bool:
        return slot in self._count

    def pick(self) -> int:
        """A free slot with the most pages mapped (does not remove it); needs len > 0."""
        for bucket in reversed(self._buckets):
            if bucket:
                return bucket.first()
        raise LookupError("no free slot")

    def add(self, slot: int, count: int) -> None:
        self._buckets[count].add(slot)
        self._count[slot] = count

    def remove(self, slot: int) -> None:
        self._buckets[self._count.pop(slot)].remove(slot)

    def recount(self, slot: int, count: int) -> None:
        """Report a free slot's new mapped-page count (no-op for a slot that is not free)."""
        old = self._count.get(slot)
        if old is not None and old != count:
            self._buckets[old].remove(slot)
            self.add(slot, count)

    def items(self):
        return self._count.items()
