"""A hypothesis machine drives a hybrid pool (hybrid_pool's cache: kind "full" = 2 member pages,
"window-8" = 4 per page index, 14 pool pages) with random extent-op plans of one to three ops,
well formed or not (a pool page outside the pool, a wrong page count, an unknown kind, a spot
mapped twice, an unmap of nothing, a copy from or into nothing), some with an injected driver
fault, against a shadow of the extents mapped per spot and the bytes each pool page holds (a
pool page keeps them wherever, and however often, it is mapped). After every plan: a plan the
shadow refuses raises CacheStateError and a faulted one PlanExecutionError, both changing
nothing; the mapped extents, the pool pages mapped and every mapped member's bytes equal the
shadow's; the cache's integrity holds."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmemkv.runtime.errors import CacheStateError, PlanExecutionError
from vmemkv.scheduler.plan import CopyExtent, MapExtent, UnmapExtent
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..runtime.hybrid_pool import FULL, FULL_PAGES, WINDOW, WINDOW_PAGES, hybrid_cache

PAGES = {FULL: FULL_PAGES, WINDOW: WINDOW_PAGES}
LAYERS = {FULL: (1,), WINDOW: (0, 2)}
POOL, SLOTS, INDEXES = 14, 2, 4
spots = st.tuples(st.integers(0, SLOTS - 1), st.integers(0, INDEXES - 1))
kinds = st.sampled_from([FULL, WINDOW, FULL, WINDOW, "window-9"])
# mostly a page per member, distinct, inside the pool; sometimes too few/many or one outside
pool_pages = st.one_of(
    kinds.flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, POOL - 1), unique=True,
                                                           min_size=PAGES.get(k, 2),
                                                           max_size=PAGES.get(k, 2)))),
    st.tuples(kinds, st.lists(st.integers(0, POOL), min_size=1, max_size=5)))
ops = st.one_of(st.builds(lambda s, kp: MapExtent(*s, kp[0], tuple(kp[1])), spots, pool_pages),
                st.builds(lambda s, k: UnmapExtent(*s, k), spots, kinds),
                st.builds(lambda a, b, k: CopyExtent(*a, *b, k), spots, spots, kinds))


class Refused(Exception):
    pass


class Shadow:
    """mapped: {(slot, index): {kind: pool pages}}; data: {pool page: value} (absent: unknown
    bytes, e.g. a page never written)."""

    def __init__(self) -> None:
        self.mapped, self.data = {}, {}

    def apply(self, op) -> None:
        """Apply ``op`` or raise Refused (a plan the executor must refuse)."""
        if op.kind not in PAGES:
            raise Refused
        if isinstance(op, MapExtent):
            spot = self.mapped.setdefault((op.slot, op.page_index), {})
            if op.kind in spot or len(op.pool_pages) != PAGES[op.kind] or \
                    any(p >= POOL for p in op.pool_pages):
                raise Refused
            spot[op.kind] = op.pool_pages
        elif isinstance(op, UnmapExtent):
            spot = self.mapped.get((op.slot, op.page_index), {})
            if op.kind not in spot:
                raise Refused
            del spot[op.kind]
        else:
            src = self.mapped.get((op.src_slot, op.src_page_index), {}).get(op.kind)
            dst = self.mapped.get((op.dst_slot, op.dst_page_index), {}).get(op.kind)
            if src is None or dst is None:
                raise Refused
            for s, d in zip(src, dst):     # member by member, in member order
                value = self.data.get(s)
                self.data.pop(d, None) if value is None else self.data.__setitem__(d, value)
        self.mapped = {s: extents for s, extents in self.mapped.items() if extents}

    def mapped_pool_pages(self) -> int:
        return len({p for extents in self.mapped.values() for pages in extents.values()
                    for p in pages})


class HybridPoolMachine(RuleBasedStateMachine):
    mapper = False

    def __init__(self) -> None:
        super().__init__()
        self.driver = FaultInjectingDriver(HostDriver())
        self.cache = hybrid_cache(pool_pages=POOL, driver=self.driver, background_mapper=self.mapper)
        self.shadow = Shadow()

    def member_views(self, slot: int, index: int, kind: str) -> list:
        """The range page of each of ``kind``'s members at (slot, index), in member order."""
        c, pb = self.cache.config, self.cache.page_bytes
        pages = [((2 * layer + kv) * c.max_batch + slot) * self.cache.pages_per_slot + index
                 for layer in LAYERS[kind] for kv in (0, 1)]
        return [self.cache.range.tensor(p * pb, pb, torch.float32) for p in pages]

    @rule(plan=st.lists(ops, min_size=1, max_size=3), fault=st.one_of(st.none(), st.tuples(
        st.sampled_from(["map", "unmap", "copy"]), st.integers(0, 3))))
    def execute(self, plan, fault):
        after = copy.deepcopy(self.shadow)
        try:
            for op in plan:
                after.apply(op)
        except Refused:
            event("refused")
            with pytest.raises(CacheStateError):
                self.cache.execute(plan)
            return
        if fault is not None:
            self.driver.fail_at(*fault)
        try:
            self.cache.execute(plan)
            self.cache.wait_for_plan()
        except PlanExecutionError:
            event("faulted")
            return                              # undone: the shadow stays as it was
        finally:
            self.driver.disarm()
        event("applied")
        self.shadow = after

    @rule(data=st.data(), value=st.floats(1, 1000, allow_nan=False))
    def write(self, data, value):
        self.cache.wait_for_plan()
        mapped = sorted((s, k, pages) for s, extents in self.shadow.mapped.items()
                        for k, pages in extents.items())
        if mapped:
            spot, kind, pages = data.draw(st.sampled_from(mapped))
            for view in self.member_views(*spot, kind):
                view.fill_(value)
            self.shadow.data.update({p: value for p in pages})

    @invariant()
    def matches_the_shadow(self):
        self.cache.wait_for_plan()
        assert self.cache.mapped_pool_pages == self.shadow.mapped_pool_pages()
        for slot in range(SLOTS):
            expected = {i: extents for (s, i), extents in self.shadow.mapped.items() if s == slot}
            assert self.cache.mapped_extents(slot) == expected
        for (slot, index), extents in self.shadow.mapped.items():
            for kind, pages in extents.items():
                for page, view in zip(pages, self.member_views(slot, index, kind)):
                    value = self.shadow.data.get(page)
                    if value is not None:
                        assert bool((view == value).all()), (slot, index, kind, page)
        self.cache.check_integrity()

    def teardown(self):
        self.cache.close()


class HybridPoolMapperMachine(HybridPoolMachine):
    mapper = True


TestHybridPoolMatchesItsShadow = HybridPoolMachine.TestCase
TestHybridPoolMatchesItsShadow.settings = settings(max_examples=60, stateful_step_count=30,
                                                   deadline=None)
TestHybridPoolOnTheMapperMatchesItsShadow = HybridPoolMapperMachine.TestCase
TestHybridPoolOnTheMapperMatchesItsShadow.settings = settings(max_examples=30, stateful_step_count=30,
                                                              deadline=None)
