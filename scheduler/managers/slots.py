"""A vmem manager's slots: ``SlotMap``, where page groups are mapped (both ways) and who owns
each slot; ``FreeSlots``, the free slots bucketed by how many pages they still have mapped, so
that placing a new sequence on "the free slot with the most pages already mapped" costs
O(distinct counts among the free slots), at most O(min(pages_per_slot, num_slots)). A bucket
exists only while a free slot has its count: memory follows the slots, never pages_per_slot
(one built up front per possible count, about 900 bytes each, held 953 MB resident for a
10 MB simulated cache at --max-len 2000000). Every change logs to the manager's open journal
(journal.py)."""
from __future__ import annotations

from typing import Optional

from ..errors import SlotError
from .journal import JDict, JList, JSet, OrderedUnits, TxnCell, journaled


class FreeSlots:
    """Set of free slots, each filed under its count of mapped pages (0..pages_per_slot).

    Guarantees: ``pick()`` returns a free slot with the maximal count (the earliest filed of
    those); a count change of a free slot must be reported with ``recount``. Only counts some
    free slot has hold a bucket (made at its first slot, dropped with its last), so memory is
    O(free slots) whatever ``pages_per_slot``; a rollback puts the dropped buckets back.
    """

    def __init__(self, num_slots: int, pages_per_slot: int,
                 cell: Optional[TxnCell] = None) -> None:
        cell = TxnCell() if cell is None else cell
        self._cell = cell
        self._buckets = JDict(cell)       # count -> its free slots (OrderedUnits, never empty)
        if num_slots:
            self._buckets[0] = OrderedUnits(cell, range(num_slots))
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
        if not self._buckets:
            raise LookupError("no free slot")
        return self._buckets[max(self._buckets)].first()

    def add(self, slot: int, count: int) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedUnits(self._cell)
        bucket.add(slot)
        self._count[slot] = count

    def remove(self, slot: int) -> None:
        self._unfile(slot, self._count.pop(slot))

    def recount(self, slot: int, count: int) -> None:
        """Report a free slot's new mapped-page count (no-op for a slot that is not free)."""
        old = self._count.get(slot)
        if old is not None and old != count:
            self._unfile(slot, old)
            self.add(slot, count)

    def _unfile(self, slot: int, count: int) -> None:
        """Take ``slot`` out of bucket ``count``, dropping the bucket when it empties."""
        bucket = self._buckets[count]
        bucket.remove(slot)
        if not bucket:
            del self._buckets[count]

    def items(self):
        return self._count.items()


class SlotMap:
    """Where a vmem manager's page groups are mapped, both ways, and who owns each slot:

        pages[slot]  {page index: group}     maps[group]  {(slot, page index)}
        owner[slot]  seq id or None          free         the free slots (FreeSlots)

    ``put`` and ``take`` change both directions and the free slot's mapped-page count together
    (the only writes); every container logs to the manager's open journal.
    """

    def __init__(self, num_slots: int, num_groups: int, pages_per_slot: int,
                 cell: TxnCell) -> None:
        self.pages = tuple(JDict(cell) for _ in range(num_slots))
        self.maps = tuple(JSet(cell) for _ in range(num_groups))
        self.owner = JList(cell, [None] * num_slots)
        self.free = FreeSlots(num_slots, pages_per_slot, cell)

    def journaled_fields(self) -> bool:
        return all(journaled(v) for v in vars(self).values())

    def put(self, slot: int, pi: int, group: int) -> None:
        """``group`` is mapped at page ``pi`` of ``slot`` (where nothing is)."""
        pages = self.pages[slot]
        pages[pi] = group
        self.maps[group].add((slot, pi))
        self.free.recount(slot, len(pages))

    def take(self, slot: int, pi: int) -> int:
        """Nothing is mapped at page ``pi`` of ``slot`` any more: the group that was."""
        pages = self.pages[slot]
        group = pages.pop(pi)
        self.maps[group].discard((slot, pi))
        self.free.recount(slot, len(pages))
        return group

    def occupy(self, seq_id: int, slot: Optional[int] = None) -> int:
        """``slot`` (default: the free slot with the most pages mapped) now holds ``seq_id``."""
        slot = self.free.pick() if slot is None else slot
        self.free.remove(slot)
        self.owner[slot] = seq_id
        return slot

    def vacate(self, slot: int) -> None:
        self.owner[slot] = None
        self.free.add(slot, len(self.pages[slot]))

    def check_free(self, seq_id: int, slot) -> None:
        """SlotError unless ``slot`` is one of these slots and free (for ``seq_id``)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self.owner):
            raise SlotError(f"sequence {seq_id}: slot {slot!r} is outside this manager's slots "
                            f"0..{len(self.owner) - 1}")
        if slot not in self.free:
            raise SlotError(f"sequence {seq_id}: slot {slot} holds sequence {self.owner[slot]}")

    def free_slot_mapping(self, group: int) -> Optional[int]:
        """The lowest free slot where ``group`` is still mapped at page 0, else None."""
        slots = [s for s, pi in self.maps[group] if pi == 0 and s in self.free]
        return min(slots) if slots else None
