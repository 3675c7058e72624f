"""Hybrid x byte-mapped: the one VmemManager over per-kind extents with a full kind beside a
windowed one AND pages that hold no whole token (3-byte layer-tokens on 4- or 5-byte pages: a
member spans 3 pages), against the hybrid machine's pool-page shadow (a hypothesis state
machine: allocate with shared prefixes and retention, append, fork, copy-on-write, free,
release_behind_window, recompute, swap, begin/commit/rollback at any step).

On top of the hybrid machine's invariants (extents equal the shadow's, a pool page backs one
group, reads through both kinds, rollback restores every field): every token is written and
read only inside mapped member pages of each kind; each page of a live sequence maps, per kind,
exactly the member pages its bytes need (ceil(fill * 3 / page_bytes)), the windowed kind none
behind the sequence's window frontier; and the pages bound are the shadow's, never the pool's
more.
"""
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize, invariant

from vmemkv.scheduler.layout import PoolBacking
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

from .shadow import group_extents
from .test_hybrid_state_machine import HybridMachine, KindMemory
from .test_managers_state_machine import _SETTINGS, EVICTION
from ..hypothesis_budget import examples


class HybridBytesMachine(HybridMachine):
    """4 layers of 3 bytes a token (one full, at index ``full``; the others within ``window``)
    on pages of 4 or 5 bytes: 3 pages a member, ``page_bytes`` tokens a group."""

    @initialize(page_bytes=st.sampled_from([4, 5]), pages=st.integers(2, 6),
                pool=st.integers(8, 160), slots=st.sampled_from([None, 1, 3, 6]),
                swap=st.integers(0, 64), window=st.integers(1, 9), full=st.integers(0, 3),
                evict=EVICTION)
    def setup(self, page_bytes, pages, pool, slots, swap, window, full, evict):
        windows = tuple(None if i == full else window for i in range(4))
        model = ModelSpec("h3", 4, 3, 1, 1, weight_bytes=0, layer_windows=windows)
        self.unit, self.window = page_bytes, window
        self.m = make_manager("vmem", model, pool * page_bytes, pages * page_bytes,
                              page_bytes=page_bytes, max_slots=slots, swap_bytes=24 * swap,
                              prefix_eviction=evict, hybrid_parts=True)
        geo = self.m.geometry
        assert self.m.backing is PoolBacking.BYTES and geo.pages_per_member == 3
        assert [k.name for k in self.m.kinds] == ["full", f"window-{window}"]
        assert (self.m.pool_pages, self.m.tokens_per_page, self.m.table.members) == \
            (pool, page_bytes, (2, 6))
        self.mem = KindMemory(self.m)

    def end_waste(self):
        """Room in the held groups' backed pages past their tokens (every member's pages)."""
        m, fill, u = self.m, {}, self.unit
        for sid, s in self.live.items():
            for k, g in enumerate(self.tables(sid)):
                fill[g] = min(u, s.num_tokens - k * u)
        gone = sum(f * 6 for g, f in fill.items() if set(group_extents(m, g)) == {"full"})
        live = (sum(fill.values()) * 8 - gone) // 8
        pages = sum(len(p) for g in fill for p in group_extents(m, g).values())
        geo = m.geometry
        return max(pages * geo.page_bytes // (geo.token_bytes * geo.num_members) - live, 0)

    @invariant()
    def each_kind_backs_the_bytes_its_tokens_need(self):
        if self.m is None:
            return
        m, geo, u = self.m, self.m.geometry, self.unit
        for sid, s in self.live.items():
            slot = m.slot_of(sid)
            frontier = self.mem.first.get(sid, 0) // u
            for pi in range(-(-s.num_tokens // u)):
                need = geo.member_pages_for(min(u, s.num_tokens - pi * u))
                want = {"full": 2 * need}
                if pi >= frontier:
                    want[self.mem.window] = 6 * need
                got = {k: len(p) for k, p in self.mem.aspace[(slot, pi)].items()}
                assert got == want, (sid, pi, got, want)


TestHybridBytesVmemMatchesShadow = HybridBytesMachine.TestCase
TestHybridBytesVmemMatchesShadow.settings = settings(_SETTINGS, max_examples=examples(100))
