"""What an executor holds after a manager's ops, for the adapter state machine
(test_adapter_machine.py): the pool pages KV maps (vmem) and the units each adapter was loaded
into, rebuilt from the ops alone, asserting that no unit is ever an adapter's and KV's at once."""
from vmemkv.scheduler.managers.base import (EvictAdapter, LoadAdapter, MapExtent, ReleasePages,
                                            UnmapExtent)


class UnitReplica:
    def __init__(self, manager) -> None:
        self.m = manager
        self.vmem = manager.name == "vmem"
        # vmem: a kind's member count (pool pages per page of a group) by kind name
        self.members = {k.name: manager.table.members[i] for i, k in enumerate(manager.kinds)} \
            if self.vmem else {}
        self.kv_map: dict = {}         # vmem: (slot, page index, kind) -> pool pages mapped
        self.adapter_pages: dict = {}  # digest -> units its LoadAdapter named

    def _held(self) -> set:
        return {p for pages in self.adapter_pages.values() for p in pages}

    def apply(self, ops, live_seq_ids) -> None:
        """Apply committed ``ops``; ``live_seq_ids``: the sequences resident after them."""
        for op in ops:
            if type(op) in (MapExtent, UnmapExtent):
                key = (op.slot, op.page_index, op.kind)
                keep = self.kv_map.pop(key, ())[:op.first_page * self.members[op.kind]]
                if type(op) is MapExtent:
                    assert not self._held() & set(op.pool_pages), ("KV maps an adapter's page", op)
                    keep += tuple(op.pool_pages)
                if keep:
                    self.kv_map[key] = keep
            elif type(op) is LoadAdapter:
                assert op.adapter_id not in self.adapter_pages
                assert not self._held() & set(op.pool_pages), ("two adapters in a unit", op)
                if self.vmem:
                    mapped = {p for pages in self.kv_map.values() for p in pages}
                    assert not mapped & set(op.pool_pages), ("an adapter in a mapped page", op)
                assert len(op.pool_pages) == self.m.adapter_pages(op.num_bytes)
                self.adapter_pages[op.adapter_id] = op.pool_pages
            elif type(op) is EvictAdapter:
                assert self.adapter_pages.pop(op.adapter_id) == op.pool_pages
            elif type(op) is ReleasePages:
                assert not self._held() & set(op.pool_pages), ("an adapter's page released", op)
        if not self.vmem:      # a block an adapter holds is in no sequence's table
            held = self._held()
            for sid in live_seq_ids:
                tables = self.m.block_tables(sid)
                assert not held & {b for t in tables for b in t if b is not None}
