"""The hybrid vmem manager (full-attention layers beside windowed ones, per-layer layout)
against a shadow model of part-split page groups (a hypothesis state machine): allocate with
shared prefixes and retention, append, fork, copy-on-write, free, release_behind_window,
recompute and swap (refused once a window part is dropped), begin/commit/rollback.

The shadow replays every op on a model of physical memory where each group has a FULL and a
WINDOW part, each bound to pages or not, and checks that the op stream is well formed: a part
is mapped only while bound (MapGroup binds), a MapGroup never targets a mapped spot, an Unmap
names exactly what is mapped there, ReleaseGroup only for a part mapped nowhere (its content
is lost). Invariants after every step: pages bound <= pool_pages and equal to the shadow's
count; every live sequence reads back its tokens through FULL (every token) and WINDOW (from
its window start on), so no part a live sequence needs is ever unmapped or unbound.
"""
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from vmemkv.scheduler.managers import (CopyGroup, GroupPart, HybridVmemManager, MapGroup,
                                       ReleaseGroup, UnmapGroup, make_manager)
from vmemkv.scheduler.presets import ModelSpec

from .shadow import VmemMemory
from .test_managers_state_machine import _SETTINGS, EVICTION, PICK, VmemMachine
from .test_window_state_machine import WindowRules

PARTS = (GroupPart.FULL, GroupPart.WINDOW)


class PartMemory(VmemMemory):
    """Address space (slot, pi) -> (group, mapped parts); per group its bound parts and, per
    part, the token contents its pages hold; per sequence the first token its window holds."""

    def __init__(self, manager):
        super().__init__(manager)
        self.parts = {}        # (slot, pi) -> set of mapped parts
        self.bound = {}        # group -> set of bound parts
        self.data = {}         # (group, part) -> {offset: content}
        self.first = {}        # seq_id -> first token its window part still holds

    def bound_pages(self):
        m = self.m
        return sum(m.full_pages if p == GroupPart.FULL else m.window_pages
                   for parts in self.bound.values() for p in parts)

    @staticmethod
    def _names(part):
        return PARTS if part == GroupPart.ALL else (part,)

    def apply(self, op):
        if isinstance(op, MapGroup):
            spot = (op.slot, op.page_index)
            assert spot not in self.aspace, f"map over a mapped page {op}"
            assert op.part in (GroupPart.ALL, GroupPart.FULL), op
            self.aspace[spot] = op.group
            self.parts[spot] = set(self._names(op.part))
            self.bound.setdefault(op.group, set()).update(self._names(op.part))
        elif isinstance(op, UnmapGroup):
            spot = (op.slot, op.page_index)
            assert self.aspace.get(spot) == op.group, op
            names = set(self._names(op.part))
            assert names <= self.parts[spot], f"unmap of a part not mapped there: {op}"
            if op.part == GroupPart.ALL or op.part == GroupPart.FULL:
                assert self.parts[spot] == names, f"unmap leaves a part mapped alone: {op}"
            self.parts[spot] -= names
            if not self.parts[spot]:
                del self.aspace[spot], self.parts[spot]
        elif isinstance(op, ReleaseGroup):
            assert op.part in PARTS and op.part in self.bound.get(op.group, ()), op
            assert all(op.part not in self.parts[s] for s, g in self.aspace.items()
                       if g == op.group), f"release of a part still mapped: {op}"
            self.bound[op.group].discard(op.part)
            self.data.pop((op.group, op.part), None)
        elif isinstance(op, CopyGroup):
            src, dst = (op.src_slot, op.src_page_index), (op.dst_slot, op.dst_page_index)
            assert self.parts[src] == self.parts[dst] == set(PARTS), op
            s, d = self.aspace[src], self.aspace[dst]
            assert s != d and self.m.ref_count(d) == 1, op
            for p in PARTS:
                self.data[(d, p)] = dict(self.data.get((s, p), {}))
        else:
            raise AssertionError(f"unexpected op {op}")

    def write(self, seq_id, pos, content):
        spot = (self.m.slot_of(seq_id), pos // self.m.tokens_per_page)
        g = self.aspace[spot]                      # KeyError: a fault
        assert self.parts[spot] == set(PARTS), "write into a page missing a part"
        assert self.m.ref_count(g) == 1, f"write into shared group {g}"
        for p in PARTS:
            self.data.setdefault((g, p), {})[pos % self.m.tokens_per_page] = content

    def read(self, seq_id, n, before=False, part=GroupPart.FULL, lo=0):
        tpp = self.m.tokens_per_page
        slot = self.slots.pop(seq_id) if before else self.m.slot_of(seq_id)
        out = []
        for p in range(lo, n):
            spot = (slot, p // tpp)
            assert part in self.parts[spot], ("a needed part is unmapped", seq_id, p, part)
            out.append(self.data.get((self.aspace[spot], part), {}).get(p % tpp))
        return out

    def check_reads(self, shadow):
        for seq_id, s in shadow.items():
            n, lo = s.num_tokens, self.first.get(seq_id, 0)
            assert self.read(seq_id, n) == s.contents[:n], seq_id
            assert self.read(seq_id, n, part=GroupPart.WINDOW, lo=lo) == s.contents[lo:n], seq_id


class HybridMachine(WindowRules, VmemMachine):
    """WindowRules' fork, swap_out (refused with WindowSwapError once a window part went) and
    free, with this machine's own slide and stats checks."""

    @initialize(tpp=st.sampled_from([1, 2, 4]), pages=st.integers(2, 10),
                pool=st.integers(8, 120), slots=st.sampled_from([None, 1, 3, 6]),
                swap=st.integers(0, 64), window=st.integers(1, 9), full=st.integers(0, 3),
                evict=EVICTION)
    def setup(self, tpp, pages, pool, slots, swap, window, full, evict):
        """4 layers, one of them full (at index ``full``), the others within ``window``; one
        byte per layer-token, so a group is 8 pages: FULL 2, WINDOW 6."""
        windows = tuple(None if i == full else window for i in range(4))
        model = ModelSpec("h", 4, 1, 1, 1, weight_bytes=0, layer_windows=windows)
        self.unit, self.window = tpp, window
        self.m = make_manager("vmem", model, pool * tpp, pages * tpp, page_bytes=tpp,
                              max_slots=slots, swap_bytes=8 * swap, prefix_eviction=evict,
                              hybrid_parts=True)
        assert isinstance(self.m, HybridVmemManager) and self.m.pool_pages == pool
        assert (self.m.full_pages, self.m.window_pages, self.m.window_tokens) == (2, 6, window)
        self.mem = PartMemory(self.m)

    @precondition(lambda self: self.live)
    @rule(i=PICK, back=st.integers(0, 3))
    def slide(self, i, back):
        """The next query of a sequence is at ``num_tokens - back``: its window parts behind
        ``that - W + 1`` go (the last page always stays whole); nothing else changes."""
        sid = self.pick(self.live, i)
        n = max(self.live[sid].num_tokens - back, 0)
        before = self.m.stats().live_tokens
        self.m.release_behind_window(sid, n)
        pages = -(-self.live[sid].num_tokens // self.unit)
        behind = max(min(max(n - self.window + 1, 0) // self.unit, pages - 1), 0)
        first = max(self.mem.first.get(sid, 0), behind * self.unit)
        self.mem.first[sid] = first
        assert self.m.full_only_pages(self.m.slot_of(sid)) == first // self.unit
        ops = self.m.take_ops()
        assert all(isinstance(op, (UnmapGroup, ReleaseGroup)) for op in ops), ops
        assert all(op.part == GroupPart.WINDOW for op in ops if isinstance(op, ReleaseGroup))
        self.mem.replay(ops, self.live)
        assert self.m.stats().live_tokens <= before

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def preempt_by_recompute(self, i):
        """The scheduler's recompute: free with what was computed, then allocate again."""
        sid = self.pick(self.live, i)
        s = self.live[sid]
        self.m.free(sid, computed_tokens=s.num_tokens)
        self.live.pop(sid)
        self.mem.first.pop(sid, None)
        self.replay()

    @invariant()
    def address_space_matches_and_allocated_is_mapped(self):
        """Replaces VmemMachine's: here the pool is counted in bound pages."""
        if self.m is None:
            return
        m = self.m
        self.mem.check_mapped()
        assert m.bound_pages == self.mem.bound_pages() <= m.pool_pages
        for g in range(m.num_groups):
            assert set(m.bound_parts(g)) == self.mem.bound.get(g, set()), g
        for slot in range(m.num_slots):
            full_only = {pi for (s, pi), parts in self.mem.parts.items()
                         if s == slot and parts == {GroupPart.FULL}}
            assert full_only == set(range(m.full_only_pages(slot))), slot

    @invariant()
    def integrity_and_stats(self):
        """Replaces ManagerMachine's: a partial group's tokens count in its FULL pages only."""
        if self.m is None:
            return
        m, stats, u = self.m, self.m.stats(), self.unit
        m.check_integrity()
        waste = sum(-(-s.num_tokens // u) * u - s.num_tokens for s in self.live.values())
        assert stats.end_waste_tokens == waste
        fill = {}
        for sid, s in self.live.items():
            for k, unit in enumerate(self.tables(sid)):
                fill[unit] = min(u, s.num_tokens - k * u)
        gone = sum(f * m.window_pages for g, f in fill.items()
                   if self.mem.bound.get(g) == {GroupPart.FULL})
        assert stats.live_tokens == (sum(fill.values()) * 8 - gone) // 8
        for sid, s in list(self.live.items()) + list(self.swapped.items()):
            assert m.num_tokens(sid) == s.num_tokens
        self.mem.check_reads(self.live)

    @invariant()
    def usage_counts_pages(self):
        if self.m is not None:
            stats = self.m.stats()
            assert stats.free_tokens + stats.allocated_tokens == stats.total_tokens
            assert stats.total_tokens == self.m.pool_pages * self.unit // 8


TestHybridVmemMatchesShadow = HybridMachine.TestCase
TestHybridVmemMatchesShadow.settings = _SETTINGS
