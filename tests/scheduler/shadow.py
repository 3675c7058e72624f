"""Shadow models for the memory-manager tests.

``Contents`` gives every token a content id that depends on its whole prefix and namespace (as a
token's K/V does). ``PagedMemory`` and ``VmemMemory`` replay a manager's ops on a model of
physical memory (block contents / an address space of (slot, page_index) -> group plus group
contents), write new tokens where the runtime would, and read every live sequence back.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

from vmemkv.scheduler.managers import CopyBlock, CopyExtent, MapExtent, SwapIn, SwapOut, UnmapExtent
from vmemkv.scheduler.managers.base import DropSwapped


def dump(value):
    """A plain, comparable copy of a manager's whole state (every field but the open
    transaction; records and helper objects field by field; LRU order kept)."""
    if isinstance(value, (str, int, float)):        # (str enums too: their members are values)
        return value
    if hasattr(value, "__slots__") and not isinstance(value, tuple):
        return (type(value).__name__, [dump(getattr(value, n)) for n in value.__slots__])
    if isinstance(value, OrderedDict):
        return ("lru", [(k, dump(v)) for k, v in value.items()])
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dump(v) for v in value]
    if isinstance(value, set):
        return set(value)
    if hasattr(value, "__dict__") and not hasattr(value, "__dataclass_fields__"):
        return {k: dump(v) for k, v in vars(value).items() if k not in ("_txn", "model")}
    return value


def ref_count(m, unit: int) -> int:
    """Holders of ``unit`` (a paged block or vmem page group), as the manager counts them."""
    return m._refs[unit]


def group_extents(m, group: int) -> dict:
    """{kind: pool pages} backing vmem ``group`` (kinds with none left out)."""
    return {kind.name: m.table.extent(k, group) for k, kind in enumerate(m.kinds)
            if m.table.extent(k, group)}


def full_only_pages(m, slot: int) -> int:
    """Leading mapped pages of vmem ``slot`` whose windowed kinds its sequence gave back."""
    return m._win_gone[slot]


class ShadowSeq:
    """What a sequence should read back: its token ids and their prefix-dependent contents."""

    def __init__(self, ids, namespace):
        self.namespace = namespace
        self.ids = []          # ids of the tokens known so far (may run ahead of num_tokens)
        self.contents = []
        self.num_tokens = 0
        self.reserved = 0
        self.extend_ids(ids)

    def extend_ids(self, ids):
        for t in ids:
            prev = self.contents[-1] if self.contents else None
            self.ids.append(t)
            self.contents.append(hash((prev, t, self.namespace)))

    def copy(self):
        c = ShadowSeq([], self.namespace)
        c.ids, c.contents = list(self.ids), list(self.contents)
        c.num_tokens, c.reserved = self.num_tokens, self.reserved
        return c


class _Memory:
    """Common replay: swap copies and the write/read checks."""

    def save(self):
        """The shadow memory's contents, for ``load`` after a manager rollback (the runtime
        cache undoes a failed plan the same way)."""
        return copy.deepcopy({k: v for k, v in vars(self).items() if k != "m"})

    def load(self, saved):
        vars(self).update(copy.deepcopy(saved))

    def __init__(self, manager):
        self.m = manager
        self.host = {}         # seq_id -> contents swapped out

    def replay(self, ops, shadow, writes=()):
        """Execute ``ops`` then write ``writes`` [(seq_id, first_pos, last_pos)]."""
        for op in ops:
            if isinstance(op, SwapOut):
                self.host[op.seq_id] = self.read(op.seq_id, op.num_tokens, before=True)
            elif isinstance(op, DropSwapped):     # freed while swapped: its copy goes
                del self.host[op.seq_id]
            elif isinstance(op, SwapIn):
                data = self.host.pop(op.seq_id)
                assert len(data) == op.num_tokens
                for p, c in enumerate(data):
                    self.write(op.seq_id, p, c)
            else:
                self.apply(op)
        for seq_id, start, end in writes:
            for p in range(start, end):
                self.write(seq_id, p, shadow[seq_id].contents[p])

    def check_reads(self, shadow):
        for seq_id, s in shadow.items():
            assert self.read(seq_id, s.num_tokens) == s.contents[:s.num_tokens], seq_id


class PagedMemory(_Memory):
    def __init__(self, manager):
        super().__init__(manager)
        self.blocks = {}       # block -> {offset: content}
        self.tables = {}       # seq_id -> block table captured before a swap-out

    def capture(self, seq_id):
        self.tables[seq_id] = self.m.block_table(seq_id)

    def apply(self, op):
        assert isinstance(op, CopyBlock), op
        assert ref_count(self.m, op.dst_block) == 1, "copy into a shared block"
        self.blocks[op.dst_block] = dict(self.blocks.get(op.src_block, {}))

    def write(self, seq_id, pos, content):
        bs = self.m.block_size
        b = self.m.block_table(seq_id)[pos // bs]
        assert ref_count(self.m, b) == 1, f"write into shared block {b}"
        self.blocks.setdefault(b, {})[pos % bs] = content

    def read(self, seq_id, n, before=False):
        bs = self.m.block_size
        table = self.tables.pop(seq_id) if before else self.m.block_table(seq_id)
        return [self.blocks.get(table[p // bs], {}).get(p % bs) for p in range(n)]

    def allocated_blocks(self, shadow):
        return {b for sid in shadow for b in self.m.block_table(sid)}


class VmemMemory(_Memory):
    """vmem memory at the pool-page level: what the ops mapped where, (slot, page index) ->
    {kind: pool pages}, and the tokens each pool page row holds. A token lives in the pool page
    of the first kind's first member at the member page its bytes start in, so a page the
    manager hands to new content without the content being written reads back stale (a fault
    the machines catch); a token is written or read only where all its bytes lie in mapped
    member pages of every kind there."""

    def __init__(self, manager):
        super().__init__(manager)
        self.aspace = {}       # (slot, page_index) -> {kind: pool pages}
        self.pages = {}        # pool page -> {token offset in its group: content}
        self.slots = {}        # seq_id -> slot captured before a swap-out
        geo, layout = manager.geometry, manager.layout()
        self.members = {name: (2 * len(layers) if geo.per_layer else 2)
                        for name, layers in layout.kinds}
        self.lead = layout.kinds[0][0]
        self.pool_pages = layout.pool_pages

    def capture(self, seq_id):
        self.slots[seq_id] = self.m.slot_of(seq_id)

    def apply(self, op):
        if isinstance(op, MapExtent):
            n, spot = self.members[op.kind], self.aspace.setdefault((op.slot, op.page_index), {})
            have = spot.get(op.kind, ())
            assert len(have) // n == op.first_page, f"map over a mapped page {op}"
            assert op.pool_pages and len(op.pool_pages) % n == 0, op
            assert all(0 <= p < self.pool_pages for p in op.pool_pages), op
            spot[op.kind] = have + op.pool_pages
        elif isinstance(op, UnmapExtent):
            spot, n = self.aspace[(op.slot, op.page_index)], self.members[op.kind]
            have = spot[op.kind]
            assert op.first_page < len(have) // n, f"unmap of nothing {op}"
            spot[op.kind] = have[:op.first_page * n]
            if not spot[op.kind]:
                del spot[op.kind]
            if not spot:
                del self.aspace[(op.slot, op.page_index)]
        elif isinstance(op, CopyExtent):
            n = self.members[op.kind]
            src = self.aspace[(op.src_slot, op.src_page_index)][op.kind]
            dst = self.aspace[(op.dst_slot, op.dst_page_index)][op.kind]
            assert src != dst and len(dst) >= len(src), f"copy past backing {op}"
            if op.num_tokens is None:   # copy-on-write: it says, and is charged, what it moves
                assert op.member_pages == len(src) // n, f"{op} names other pages than {len(src) // n}"
                assert self.m.copied_bytes([op]) == len(src) * self.m.page_bytes, op
            if op.kind == self.lead:
                for i in range(len(src) // n):
                    self.pages[dst[i * n]] = dict(self.pages.get(src[i * n], {}))
        else:
            raise AssertionError(f"unexpected op {op}")

    def _page(self, slot, pos):
        """The pool page holding token ``pos`` of ``slot`` (KeyError / AssertionError: a fault)."""
        tpp, geo = self.m.tokens_per_page, self.m.geometry
        spot, offset = self.aspace[(slot, pos // tpp)], pos % tpp
        need = geo.member_pages_for(offset + 1)
        for kind, pages in spot.items():
            assert len(pages) // self.members[kind] >= need, f"token {pos} past the mapped pages"
        start = offset * geo.token_bytes // geo.page_bytes
        return spot[self.lead][start * self.members[self.lead]], offset

    def write(self, seq_id, pos, content):
        slot = self.m.slot_of(seq_id)
        g = self.m.mapped_pages(slot)[pos // self.m.tokens_per_page]
        assert ref_count(self.m, g) == 1, f"write into shared group {g}"
        page, offset = self._page(slot, pos)
        self.pages.setdefault(page, {})[offset] = content

    def read(self, seq_id, n, before=False):
        slot = self.slots.pop(seq_id) if before else self.m.slot_of(seq_id)
        out = []
        for p in range(n):
            page, offset = self._page(slot, p)
            out.append(self.pages.get(page, {}).get(offset))
        return out

    def check_mapped(self):
        per_slot = {}
        for (slot, pi), extents in self.aspace.items():
            per_slot.setdefault(slot, {})[pi] = dict(extents)
        for slot in range(self.m.num_slots):
            assert self.m.mapped_extents(slot) == per_slot.get(slot, {}), slot


def in_transaction(cell, change, commit: bool) -> bool:
    """Run ``change()`` inside a transaction of ``cell`` (a TxnCell), then commit it or roll
    it back; returns ``commit`` (the caller restores its shadow when False)."""
    cell.open({})
    try:
        change()
    finally:
        if commit:
            cell.commit()
        else:
            cell.rollback([], [])
    return commit
