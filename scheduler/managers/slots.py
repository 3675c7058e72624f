"""Free vmem slots bucketed by how many pages they still have mapped, so that placing a new
sequence on "the free slot with the most pages already mapped" is O(pages_per_slot), not
O(num_slots)."""
from __future__ import annotations


class FreeSlots:
    """Set of free slots, each filed under its count of mapped pages (0..pages_per_slot).

    Guarantees: ``pick()`` returns a free slot with the maximal count (the earliest filed of
    those); a count change of a free slot must be reported with ``recount``.
    """

    def __init__(self, num_slots: int, pages_per_slot: int) -> None:
        self._buckets = [dict() for _ in range(pages_per_slot + 1)]   # count -> {slot: None}
        self._buckets[0] = dict.fromkeys(range(num_slots))
        self._count = {s: 0 for s in range(num_slots)}                # free slot -> its count

    def copy(self) -> "FreeSlots":
        c = FreeSlots(0, len(self._buckets) - 1)
        c._buckets, c._count = list(map(dict.copy, self._buckets)), dict(self._count)
        return c

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, slot: int) -> bool:
        return slot in self._count

    def pick(self) -> int:
        """A free slot with the most pages mapped (does not remove it); needs len > 0."""
        for bucket in reversed(self._buckets):
            if bucket:
                return next(iter(bucket))
        raise LookupError("no free slot")

    def add(self, slot: int, count: int) -> None:
        self._buckets[count][slot] = None
        self._count[slot] = count

    def remove(self, slot: int) -> None:
        del self._buckets[self._count.pop(slot)][slot]

    def recount(self, slot: int, count: int) -> None:
        """Report a free slot's new mapped-page count (no-op for a slot that is not free)."""
        old = self._count.get(slot)
        if old is not None and old != count:
            del self._buckets[old][slot]
            self.add(slot, count)

    def items(self):
        return self._count.items()
