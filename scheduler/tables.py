"""Table trackers: the planner's record of where it told the executor each sequence lives.

A real cache executes plans without ever asking the manager, so every placement change must
travel in the plan. A tracker compares the manager's current placement of each scheduled
sequence with the last one it sent and emits only the difference:

    vmem    SetSlot(seq, slot)                      when the slot is new or changed
    paged   EditBlocks(seq, keep, append)           table := table[:keep] + append
    both    DropTable(seq)                          finished or preempted: forget it

A decode that stays inside its last block/page emits nothing. If a plan is dropped without
being executed, call ``resend()``: the next plans then carry full placements again.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from .errors import ConfigError
from .layout import CacheKind
from .plan import DropTable, EditBlocks, SetSlot, StepPlan, TableEdit


class TableTracker:
    """Base: the sent record and the edit list; subclasses say how a placement is read."""

    def __init__(self) -> None:
        self._sent: dict = {}     # seq_id -> the placement last sent

    def edits(self, manager, seq_ids: Iterable[int], dropped: Iterable[int] = ()) -> List[TableEdit]:
        """Edits that bring an executor's replica up to date for ``seq_ids`` (resident in
        ``manager``), after forgetting ``dropped``. Drops come first."""
        out: List[TableEdit] = []
        sent = self._sent
        for seq_id in dropped:
            if sent.pop(seq_id, None) is not None:
                out.append(DropTable(seq_id))
        for seq_id in seq_ids:
            out.extend(self._edits(manager, seq_id))
        return out

    def fill(self, plan: StepPlan, manager) -> None:
        """Set ``plan.tables`` for the plan's sequences, dropping finished and preempted ones."""
        plan.tables = self.edits(manager, [s.seq_id for s in plan.seqs],
                                 plan.finished + plan.preempted)

    def drop(self, seq_ids: Iterable[int]) -> List[TableEdit]:
        """Edits that make an executor forget ``seq_ids`` for good (an ended request's): one
        DropTable each, whether or not a placement was sent since the last ``resend`` (which
        forgets what was sent, not what the executor holds; a drop of nothing is a no-op)."""
        for seq_id in seq_ids:
            self._sent.pop(seq_id, None)
        return [DropTable(seq_id) for seq_id in seq_ids]

    def resend(self) -> None:
        """Forget what was sent (a plan was dropped unexecuted): the next edits are full."""
        self._sent.clear()

    def _edits(self, manager, seq_id: int) -> List[TableEdit]:
        raise NotImplementedError


class SlotTables(TableTracker):
    """vmem: a sequence's placement is its slot."""

    def _edits(self, manager, seq_id: int) -> List[SetSlot]:
        slot = manager.slot_of(seq_id)
        if self._sent.get(seq_id) == slot:
            return []
        self._sent[seq_id] = slot
        return [SetSlot(seq_id, slot)]


class BlockTables(TableTracker):
    """paged: a sequence's placement is its block tables (one per block group); only the
    changed tail of each changed table is sent."""

    def _edits(self, manager, seq_id: int) -> List[EditBlocks]:
        tables = manager.block_tables(seq_id)
        old = self._sent.get(seq_id)
        self._sent[seq_id] = tables
        edits = (_edit(seq_id, g, None if old is None else old[g], t) for g, t in enumerate(tables))
        return [e for e in edits if e is not None]


def _edit(seq_id: int, group: int, old: Optional[list], table: list) -> Optional[EditBlocks]:
    keep = 0
    if old is not None:
        n = len(old)
        if table[:n] == old:             # growth: append only (the common case)
            if len(table) == n:
                return None
            keep = n
        else:                            # copy-on-write replaced a block: longest prefix
            limit = min(n, len(table))
            while keep < limit and table[keep] == old[keep]:
                keep += 1
    return EditBlocks(seq_id, keep, tuple(table[keep:]), group)


def tracker_for(cache_kind: str) -> TableTracker:
    """The tracker a ``"vmem"`` or ``"paged"`` executor needs."""
    trackers = {CacheKind.VMEM: SlotTables, CacheKind.PAGED: BlockTables}
    if cache_kind in trackers:
        return trackers[CacheKind(cache_kind)]()
    raise ConfigError(f"cache kind must be 'vmem' or 'paged', got {cache_kind!r}")
