"""The vmem manager's elastic pool (scheduler/managers/elastic.py) against a shadow: a
hypothesis state machine over allocate (shared prefixes, retention), append, fork, free and
``resize`` to any size up to the max, each inside a transaction committed or rolled back at
random, on whole-token pages, pages spanning members (BYTES) and a hybrid with a windowed kind.

After every rule: the integrity check holds (every pool page free, bound to one group's kind,
or RELEASED to the device, exactly once); the pages in service are what the last committed
resize set (a shrink that could not finish reports exactly the bytes it left, which live
sequences hold); live sequences keep their tokens; no page bound or named by an op since is
RELEASED; every page a ReleasePages op named is RELEASED and was unmapped first (the op
stream, replayed on a replica of what is mapped where, never releases a mapped page).
"""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
import pytest

from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.base import MapExtent, ReleasePages, UnmapExtent
from vmemkv.scheduler.managers.ledger import RELEASED
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples

UNIFORM = ModelSpec("u4", 4, 1, 2, 2, weight_bytes=0)          # 8 bytes a layer-token
HYBRID = ModelSpec("h4", 4, 3, 1, 1, weight_bytes=0, layer_windows=(None, 6, 6, 6))
GEOMETRIES = {   # name: (model, page_bytes, layout, max tokens)
    "per-layer": (UNIFORM, 32, "per-layer", 16),       # 4 tokens a page, WHOLE
    "interleaved": (UNIFORM, 128, "interleaved", 16),  # 4 tokens a page, every layer
    "bytes-hybrid": (HYBRID, 4, "per-layer", 12),      # 3-byte tokens on 4-byte pages: BYTES
}


class Replica:
    """What an executor would hold: (slot, page index, kind) -> pool pages mapped, from member
    page 0 (``members``: kind -> members, for a partial unmap's first page)."""

    def __init__(self, members: dict) -> None:
        self.members, self.mapped = members, {}

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, (MapExtent, UnmapExtent)):
                key = (op.slot, op.page_index, op.kind)
                have = self.mapped.pop(key, ())
                keep = have[:op.first_page * self.members[op.kind]]
                assert len(keep) == op.first_page * self.members[op.kind], op
                if isinstance(op, MapExtent):
                    keep += tuple(op.pool_pages)
                if keep:
                    self.mapped[key] = keep
            elif isinstance(op, ReleasePages):
                mapped = {p for pages in self.mapped.values() for p in pages}
                assert not mapped & set(op.pool_pages), "a mapped page released"


class ElasticMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = None

    @initialize(geometry=st.sampled_from(sorted(GEOMETRIES)), start=st.integers(2, 10),
                extra=st.integers(0, 10), evict=st.sampled_from(["lru", "off"]))
    def setup(self, geometry, start, extra, evict):
        model, page_bytes, layout, max_tokens = GEOMETRIES[geometry]
        probe = make_manager("vmem", model, 256 * page_bytes, max_tokens, page_bytes=page_bytes,
                             layout=layout, hybrid_parts=True, max_slots=1)   # its geometry
        unit = page_bytes * probe.geometry.num_members   # one page of every member
        self.m = make_manager("vmem", model, start * unit, max_tokens, page_bytes=page_bytes,
                              layout=layout, max_slots=4, prefix_eviction=evict,
                              hybrid_parts=True, max_cache_bytes=(start + extra) * unit)
        self.unit, self.max_tokens = unit, max_tokens
        self.replica = Replica({k.name: self.m.table.members[i]
                                for i, k in enumerate(self.m.kinds)})
        self.capacity = self.m.capacity_pages
        assert self.capacity == self.m.pool_pages - self.m.layout().released_pages
        self.live: dict = {}           # seq id -> tokens
        self.next_id = 0

    def _txn(self, change, commit: bool):
        m = self.m
        m.begin()
        before = (dict(self.live), self.capacity)
        try:
            result = change()
        except OutOfCapacityError:
            m.rollback()
            self.live, self.capacity = before
            return None
        if commit:
            m.commit()
            self.replica.apply(m.take_ops())
        else:
            m.rollback()
            m.take_ops()
            self.live, self.capacity = before
        return result

    @precondition(lambda self: self.m is not None)
    @rule(tokens=st.integers(1, 16), shared=st.booleans(), commit=st.booleans())
    def allocate(self, tokens, shared, commit):
        tokens = min(tokens, self.max_tokens)
        ids = list(range(tokens)) if shared else [1000 + self.next_id] * tokens
        sid = self.next_id
        if not self.m.can_allocate(tokens, ids):
            return
        self.next_id += 1

        def go():
            self.m.allocate(sid, tokens, ids)
            self.m.mark_computed(sid, tokens)
            self.live[sid] = tokens
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), n=st.integers(1, 5), commit=st.booleans())
    def append(self, data, n, commit):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        if self.live[sid] + n > self.max_tokens or not self.m.can_append(sid, n):
            return

        def go():
            self.m.append(sid, n)
            self.live[sid] += n
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), commit=st.booleans())
    def free(self, data, commit):
        sid = data.draw(st.sampled_from(sorted(self.live)))

        def go():
            self.m.free(sid, computed_tokens=self.live.pop(sid))
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), commit=st.booleans())
    def fork(self, data, commit):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        if not self.m.can_fork(sid):
            return
        child = self.next_id
        self.next_id += 1

        def go():
            self.m.fork(sid, child)
            self.live[child] = self.live[sid]
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None)
    @rule(slices=st.integers(0, 24), commit=st.booleans())
    def resize(self, slices, commit):
        m = self.m
        target_bytes = slices * self.unit
        if m._pages_for(target_bytes) > m.pool_pages:
            with pytest.raises(ConfigError, match="max_cache_bytes"):
                m.resize(target_bytes)
            return
        target = m._pages_for(target_bytes)
        held_before = m.capacity_pages - m.free_pages

        def go():
            short = m.resize(target_bytes)
            assert short % m.page_bytes == 0
            assert m.capacity_pages == target + short // m.page_bytes
            if short:     # what is left is what live sequences hold (nothing else to free)
                assert not m._reclaimable and not len(m._cache) and not m.free_pages
                assert m.capacity_pages <= max(held_before, target)
            self.capacity = m.capacity_pages
            return short
        self._txn(go, commit)

    @invariant()
    def accounted_once(self):
        m = self.m
        if m is None:
            return
        m.check_integrity()
        assert m.capacity_pages == self.capacity
        assert m.ledger.released_pages + m.capacity_pages == m.pool_pages
        assert m.bound_pages + m.free_pages == m.capacity_pages
        assert {s: m.num_tokens(s) for s in self.live} == self.live
        assert m.stats().total_tokens == m._tokens(m.capacity_pages)
        mapped = {p for pages in self.replica.mapped.values() for p in pages}
        assert all(m.ledger.holder(p) != RELEASED for p in mapped), "a mapped page is released"


TestElasticVmemPool = ElasticMachine.TestCase
TestElasticVmemPool.settings = settings(max_examples=examples(120), stateful_step_count=40,
                                        deadline=None)


def test_a_shrink_gives_back_free_then_reclaimable_then_cached_pages_in_that_order():
    m = make_manager("vmem", UNIFORM, 8 * 256, 16, page_bytes=32, max_slots=4,
                     max_cache_bytes=8 * 256)    # 64 pages: 8 groups of 8 (8 tokens each)
    assert (m.tokens_per_page, m.pages_per_group, m.pool_pages) == (8, 8, 64)
    m.allocate(0, 8, list(range(8)))
    m.mark_computed(0, 8)
    m.free(0, computed_tokens=8)                 # cached (registered, lru)
    m.allocate(1, 4, [50] * 4)
    m.allocate(2, 4, [60] * 4)                   # held
    m.free(1)                                    # not computed: reclaimable, still mapped
    m.take_ops()
    assert (m.free_pages, len(m._free), len(m._cache), len(m._reclaimable)) == (0, 5, 1, 1)
    # free groups' pages first (WHOLE: 5 free groups keep 8 pages each): no unmap, no eviction
    assert m.resize(3 * 256) == 0
    ops = m.take_ops()
    assert [type(op) for op in ops] == [ReleasePages] and len(ops[0].pool_pages) == 40
    assert (len(m._free), len(m._cache), len(m._reclaimable)) == (0, 1, 1)
    # then the reclaimable group (unmapped under its free slot), then the cached one
    assert m.resize(2 * 256) == 0
    ops = m.take_ops()
    assert [type(op) for op in ops] == [UnmapExtent, ReleasePages]
    assert (len(m._cache), len(m._reclaimable), m.cached_tokens) == (1, 0, 8)
    assert m.resize(1 * 256) == 0
    assert (len(m._cache), m.cached_tokens) == (0, 0)
    # the held group stays: shrinking to nothing leaves exactly its pages, reported in bytes
    assert m.resize(0) == 8 * 32
    assert m.capacity_pages == 8 and m.num_tokens(2) == 4
    m.check_integrity()
    # and growing back serves a new sequence at once (its pages created when mapped)
    m.take_ops()
    assert m.resize(8 * 256) == 0 and m.take_ops() == []
    assert m.can_allocate(16)
    m.allocate(3, 16)
    assert all(m.ledger.holder(p) != RELEASED for op in m.take_ops()
               if isinstance(op, MapExtent) for p in op.pool_pages)


def test_released_pages_start_past_the_initial_size_and_only_vmem_resizes():
    m = make_manager("vmem", UNIFORM, 2 * 256, 64, page_bytes=32, max_cache_bytes=5 * 256)
    assert (m.pool_pages, m.capacity_pages, m.layout().released_pages) == (40, 16, 24)
    assert all(m.ledger.holder(p) == RELEASED for p in range(16, 40))
    assert m.cache_bytes == 16 * 32 and m.max_cache_bytes == 40 * 32
    assert m.stats().total_tokens == 16 and m.max_sequence_tokens == 16
    m.resize(5 * 256)
    assert m.stats().total_tokens == 40 and m.max_sequence_tokens == 40
    with pytest.raises(ConfigError, match="max_cache_bytes=1280"):
        m.resize(6 * 256)
    with pytest.raises(ConfigError, match="max_cache_bytes=100 is below cache_bytes=512"):
        make_manager("vmem", UNIFORM, 2 * 256, 16, page_bytes=32, max_cache_bytes=100)
    paged = make_manager("paged", UNIFORM, 4096, 16)
    with pytest.raises(ConfigError, match="policy 'paged' cannot resize"):
        paged.resize(2048)
    with pytest.raises(ConfigError, match="max_cache_bytes needs policy 'vmem'"):
        make_manager("paged", UNIFORM, 4096, 16, max_cache_bytes=8192)
