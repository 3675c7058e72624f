"""The hybrid vmem manager (full-attention layers beside windowed ones, per-layer layout)
against a shadow model of pool pages (a hypothesis state machine): allocate with shared
prefixes and retention, append, fork, copy-on-write, free, release_behind_window, recompute
and swap (refused once a window kind is given back), begin/commit/rollback.

The shadow replays every op on a model of physical memory: (slot, page index) -> {kind: pool
pages} ("full" = the full layer's members, "window-W" = the windowed ones'), and the tokens
each pool page holds; it checks that the op stream is well formed (a MapExtent never targets a
mapped spot, names pool pages inside the pool, an UnmapExtent names what is mapped there, a
copy names both kinds' extents of two groups). Invariants after every step: the manager's
mapped extents equal the shadow's; a pool page backs one group only, every spot mapping a group
maps the same pool pages of it, and the pages bound to groups never exceed the pool (the
ledger's count); every live sequence reads back its tokens through the full kind (every token)
and the window kind (from its window start on), so no page a live sequence needs is unmapped
or handed to another group.
"""
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from vmemkv.scheduler.managers import CopyExtent, UnmapExtent, make_manager
from vmemkv.scheduler.presets import ModelSpec

from .shadow import VmemMemory, full_only_pages, group_extents, ref_count
from .test_managers_state_machine import _SETTINGS, EVICTION, PICK, VmemMachine
from .test_window_state_machine import WindowRules


class KindMemory(VmemMemory):
    """VmemMemory per layer kind: the tokens each kind's (first member's) pool page holds, per
    sequence the first token its window kind still holds."""

    def __init__(self, manager):
        super().__init__(manager)
        self.full, self.window = (k.name for k in manager.kinds)
        self.first = {}        # seq_id -> first token its window kind still holds

    def apply(self, op):
        if isinstance(op, CopyExtent):
            src = self.aspace[(op.src_slot, op.src_page_index)]
            dst = self.aspace[(op.dst_slot, op.dst_page_index)]
            assert set(src) == set(dst) == {self.full, self.window}, op
            assert src[op.kind] != dst[op.kind], op
            self.pages[dst[op.kind][0]] = dict(self.pages.get(src[op.kind][0], {}))
            return
        super().apply(op)

    def backed(self, spot, kind, offset):
        """Whether every member page holding group offset ``offset``'s bytes is mapped."""
        need = self.m.geometry.member_pages_for(offset + 1)
        return len(spot[kind]) // self.members[kind] >= need

    def write(self, seq_id, pos, content):
        slot, tpp = self.m.slot_of(seq_id), self.m.tokens_per_page
        spot = self.aspace[(slot, pos // tpp)]                    # KeyError: a fault
        assert set(spot) == {self.full, self.window}, "write into a page missing a kind"
        assert all(self.backed(spot, k, pos % tpp) for k in spot), "write past the backing"
        g = self.m.mapped_pages(slot)[pos // tpp]
        assert ref_count(self.m, g) == 1, f"write into shared group {g}"
        for pages in spot.values():
            self.pages.setdefault(pages[0], {})[pos % tpp] = content

    def read(self, seq_id, n, before=False, kind=None, lo=0):
        tpp, kind = self.m.tokens_per_page, kind or self.full
        slot = self.slots.pop(seq_id) if before else self.m.slot_of(seq_id)
        out = []
        for p in range(lo, n):
            spot = self.aspace[(slot, p // tpp)]
            assert kind in spot, ("a needed kind is unmapped", seq_id, p, kind)
            assert self.backed(spot, kind, p % tpp), ("read past the backing", seq_id, p, kind)
            out.append(self.pages.get(spot[kind][0], {}).get(p % tpp))
        return out

    def check_reads(self, shadow):
        for seq_id, s in shadow.items():
            n, lo = s.num_tokens, self.first.get(seq_id, 0)
            assert self.read(seq_id, n) == s.contents[:n], seq_id
            assert self.read(seq_id, n, kind=self.window, lo=lo) == s.contents[lo:n], seq_id

    def pages_of_groups(self) -> dict:
        """{group: {kind: pool pages}} from every spot (AssertionError: two spots mapping one
        group name different pages, or one pool page backs two groups)."""
        groups, owner = {}, {}
        for (slot, pi), extents in self.aspace.items():
            g = self.m.mapped_pages(slot)[pi]
            for kind, pages in extents.items():
                assert groups.setdefault(g, {}).setdefault(kind, pages) == pages, (g, kind)
                for p in pages:
                    assert owner.setdefault(p, g) == g, f"pool page {p} backs {owner[p]} and {g}"
        return groups


class HybridMachine(WindowRules, VmemMachine):
    """WindowRules' fork, swap_out (refused with WindowSwapError once a window kind went) and
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
        assert [k.name for k in self.m.kinds] == ["full", f"window-{window}"]
        assert self.m.pool_pages == pool   # members (pages of a group) per kind: full 2, window 6
        assert (self.m.table.members, self.m.window_tokens) == ((2, 6), window)
        self.mem = KindMemory(self.m)

    @precondition(lambda self: self.live)
    @rule(i=PICK, back=st.integers(0, 3))
    def slide(self, i, back):
        """The next query of a sequence is at ``num_tokens - back``: its window kind's pages
        behind ``that - W + 1`` are unmapped (the last page always stays whole), given back to
        the ledger where no holder reads them (no op); nothing else changes."""
        sid = self.pick(self.live, i)
        n = max(self.live[sid].num_tokens - back, 0)
        before = self.m.stats().live_tokens
        self.m.release_behind_window(sid, n)
        pages = -(-self.live[sid].num_tokens // self.unit)
        behind = max(min(max(n - self.window + 1, 0) // self.unit, pages - 1), 0)
        first = max(self.mem.first.get(sid, 0), behind * self.unit)
        self.mem.first[sid] = first
        assert full_only_pages(self.m, self.m.slot_of(sid)) == first // self.unit
        ops = self.m.take_ops()
        free = self.m.ledger.free_pages
        slot = self.m.slot_of(sid)   # only unmaps; the full kind only of deferred mappings
        assert all(isinstance(op, UnmapExtent) for op in ops), ops
        assert all(op.kind == self.mem.window or op.slot != slot for op in ops), ops
        self.mem.replay(ops, self.live)
        assert self.m.ledger.free_pages >= free
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
        """Replaces VmemMachine's: here the pool is counted in pool pages bound to groups."""
        if self.m is None:
            return
        m = self.m
        self.mem.check_mapped()
        groups = self.mem.pages_of_groups()
        mapped = {p for kinds in groups.values() for pages in kinds.values() for p in pages}
        bound = sum(len(pages) for g in range(m.num_groups)
                    for pages in group_extents(m, g).values())
        assert len(mapped) <= m.bound_pages == bound == m.pool_pages - m.ledger.free_pages \
            <= m.pool_pages
        for g, kinds in groups.items():       # a group's mapped kinds have pages bound
            assert set(group_extents(m, g)) >= set(kinds), (g, kinds)
        for slot in range(m.num_slots):
            full_only = {pi for (s, pi), extents in self.mem.aspace.items()
                         if s == slot and set(extents) == {self.mem.full}}
            assert full_only == set(range(full_only_pages(m, slot))), slot

    @invariant()
    def integrity_and_stats(self):
        """Replaces ManagerMachine's: a partial group's tokens count in its FULL pages only."""
        if self.m is None:
            return
        m, stats, u = self.m, self.m.stats(), self.unit
        m.check_integrity()
        assert stats.end_waste_tokens == self.end_waste()
        fill = {}
        for sid, s in self.live.items():
            for k, unit in enumerate(self.tables(sid)):
                fill[unit] = min(u, s.num_tokens - k * u)
        gone = sum(f * 6 for g, f in fill.items()       # 6 window pages a group
                   if set(group_extents(m, g)) == {self.mem.full})
        assert stats.live_tokens == (sum(fill.values()) * 8 - gone) // 8
        for sid, s in list(self.live.items()) + list(self.swapped.items()):
            assert m.num_tokens(sid) == s.num_tokens
        self.mem.check_reads(self.live)

    @invariant()
    def usage_counts_pages(self):
        if self.m is not None:
            stats = self.m.stats()
            assert stats.free_tokens + stats.allocated_tokens == stats.total_tokens
            geo = self.m.geometry
            assert stats.total_tokens == self.m.pool_pages * geo.page_bytes // (
                geo.token_bytes * geo.num_members)


TestHybridVmemMatchesShadow = HybridMachine.TestCase
TestHybridVmemMatchesShadow.settings = _SETTINGS
