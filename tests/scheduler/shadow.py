"""Shadow models for the memory-manager tests.

``Contents`` gives every token a content id that depends on its whole prefix and namespace (as a
token's K/V does). ``PagedMemory`` and ``VmemMemory`` replay a manager's ops on a model of
physical memory (block contents / an address space of (slot, page_index) -> group plus group
contents), write new tokens where the runtime would, and read every live sequence back.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

from vmemkv.scheduler.managers import (ByteMappedVmemManager, CopyBlock, CopyGroup, MapGroup,
                                       ResizeGroup, SwapIn, SwapOut, UnmapGroup)
from vmemkv.scheduler.managers.base import DropSwapped


def dump(value):
    """A plain, comparable copy of a manager's whole state (every field but the open
    transaction; records and helper objects field by field; LRU order kept)."""
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
        assert self.m.ref_count(op.dst_block) == 1, "copy into a shared block"
        self.blocks[op.dst_block] = dict(self.blocks.get(op.src_block, {}))

    def write(self, seq_id, pos, content):
        bs = self.m.block_size
        b = self.m.block_table(seq_id)[pos // bs]
        assert self.m.ref_count(b) == 1, f"write into shared block {b}"
        self.blocks.setdefault(b, {})[pos % bs] = content

    def read(self, seq_id, n, before=False):
        bs = self.m.block_size
        table = self.tables.pop(seq_id) if before else self.m.block_table(seq_id)
        return [self.blocks.get(table[p // bs], {}).get(p % bs) for p in range(n)]

    def allocated_blocks(self, shadow):
        return {b for sid in shadow for b in self.m.block_table(sid)}


class VmemMemory(_Memory):
    """vmem memory; on a byte-mapped manager (members of k > 1 pages) each group is backed by
    the member pages ResizeGroup ops gave it, and a token is written or read only where all
    its bytes lie in backed pages (a shrink loses the tokens it cuts)."""

    def __init__(self, manager):
        super().__init__(manager)
        self.aspace = {}       # (slot, page_index) -> group
        self.groups = {}       # group -> {offset: content}
        self.slots = {}        # seq_id -> slot captured before a swap-out
        self.backed = {}       # group -> member pages backed (byte-mapped managers only)
        self.by_bytes = isinstance(manager, ByteMappedVmemManager)

    def _backed_tokens(self, g):
        """Tokens of group ``g`` whose bytes lie wholly in its backed pages (all: fixed groups)."""
        if not self.by_bytes:
            return self.m.tokens_per_page
        return self.m.geometry.tokens_in_member_pages(self.backed.get(g, 0))

    def _resize(self, op):
        assert 0 <= op.member_pages <= self.m.geometry.pages_per_member, op
        self.backed[op.group] = op.member_pages
        keep = self._backed_tokens(op.group)
        content = self.groups.get(op.group, {})
        self.groups[op.group] = {o: c for o, c in content.items() if o < keep}

    def capture(self, seq_id):
        self.slots[seq_id] = self.m.slot_of(seq_id)

    def apply(self, op):
        if isinstance(op, MapGroup):
            assert (op.slot, op.page_index) not in self.aspace, f"map over a mapped page {op}"
            self.aspace[(op.slot, op.page_index)] = op.group
        elif isinstance(op, UnmapGroup):
            assert self.aspace.pop((op.slot, op.page_index), None) == op.group, op
        elif isinstance(op, CopyGroup):
            src = self.aspace[(op.src_slot, op.src_page_index)]
            dst = self.aspace[(op.dst_slot, op.dst_page_index)]
            assert src != dst and self.m.ref_count(dst) == 1, op
            assert self._backed_tokens(dst) >= self._backed_tokens(src), f"copy past backing {op}"
            self.groups[dst] = dict(self.groups.get(src, {}))
        elif isinstance(op, ResizeGroup):
            self._resize(op)
        else:
            raise AssertionError(f"unexpected op {op}")

    def write(self, seq_id, pos, content):
        tpp = self.m.tokens_per_page
        g = self.aspace[(self.m.slot_of(seq_id), pos // tpp)]   # KeyError: a fault
        assert self.m.ref_count(g) == 1, f"write into shared group {g}"
        assert pos % tpp < self._backed_tokens(g), f"write of token {pos} past group {g}'s pages"
        self.groups.setdefault(g, {})[pos % tpp] = content

    def read(self, seq_id, n, before=False):
        tpp = self.m.tokens_per_page
        slot = self.slots.pop(seq_id) if before else self.m.slot_of(seq_id)
        groups = [self.aspace[(slot, p // tpp)] for p in range(n)]     # KeyError: a fault
        assert all(p % tpp < self._backed_tokens(g) for p, g in enumerate(groups)), "unbacked read"
        return [self.groups.get(g, {}).get(p % tpp) for p, g in enumerate(groups)]

    def check_mapped(self):
        per_slot = {}
        for (slot, pi), g in self.aspace.items():
            per_slot.setdefault(slot, {})[pi] = g
        for slot in range(self.m.num_slots):
            assert self.m.mapped_pages(slot) == per_slot.get(slot, {}), slot
