"""A hypothesis machine drives a hybrid pool (hybrid_pool's cache: FULL = 2 pages, WINDOW = 4 per
group, 14 pool pages, 4 groups) with random part-op plans of one to three ops, well formed or not,
some with an injected driver fault, against a shadow of bound parts, mapped parts per spot and
the bytes each bound part holds. After every plan: a plan the shadow refuses raises
CacheStateError and a faulted one PlanExecutionError, both changing nothing; bound pages, mapped
parts and every mapped member's bytes equal the shadow's; the cache's integrity holds."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmemkv.runtime.errors import CacheStateError, PlanExecutionError
from vmemkv.scheduler.plan import CopyGroup, GroupPart, MapGroup, ReleaseGroup, UnmapGroup
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..runtime.hybrid_pool import FULL_PAGES, WINDOW_PAGES, hybrid_cache

FULL, WINDOW = GroupPart.FULL, GroupPart.WINDOW
PAGES = {FULL: FULL_PAGES, WINDOW: WINDOW_PAGES}
LAYERS = {FULL: (1,), WINDOW: (0, 2)}
POOL, GROUPS, SLOTS, INDEXES = 14, 4, 2, 4
spots = st.tuples(st.integers(0, SLOTS - 1), st.integers(0, INDEXES - 1))
parts = st.sampled_from([GroupPart.ALL, FULL, WINDOW])
groups = st.integers(0, GROUPS - 1)
ops = st.one_of(st.builds(lambda s, g, p: MapGroup(*s, g, p), spots, groups, parts),
                st.builds(lambda s, g, p: UnmapGroup(*s, g, p), spots, groups, parts),
                st.builds(ReleaseGroup, groups, parts),
                st.builds(lambda a, b: CopyGroup(*a, *b), spots, spots))


class Refused(Exception):
    pass


class Shadow:
    """bound: {(group, part)}; mapped: {(slot, index): {part: group}}; data: {(group, part): value}
    (absent: unknown bytes, e.g. pages just bound)."""

    def __init__(self) -> None:
        self.bound, self.mapped, self.data = set(), {}, {}

    def apply(self, op) -> None:
        """Apply ``op`` or raise Refused (a plan the executor must refuse)."""
        concrete = (FULL, WINDOW) if getattr(op, "part", None) == GroupPart.ALL else (getattr(op, "part", None),)
        if isinstance(op, MapGroup):
            spot = self.mapped.setdefault((op.slot, op.page_index), {})
            need = sum(PAGES[p] for p in concrete if (op.group, p) not in self.bound)
            if any(p in spot for p in concrete) or any(g != op.group for g in spot.values()) \
                    or need > POOL - sum(PAGES[p] for _, p in self.bound):
                raise Refused
            self.bound |= {(op.group, p) for p in concrete}
            spot.update({p: op.group for p in concrete})
        elif isinstance(op, UnmapGroup):
            spot = self.mapped.get((op.slot, op.page_index), {})
            if any(spot.get(p) != op.group for p in concrete):
                raise Refused
            for p in concrete:
                del spot[p]
        elif isinstance(op, ReleaseGroup):
            mapped = {(g, p) for spot in self.mapped.values() for p, g in spot.items()}
            if any((op.group, p) not in self.bound or (op.group, p) in mapped for p in concrete):
                raise Refused
            for p in concrete:
                self.bound.discard((op.group, p))
                self.data.pop((op.group, p), None)
        else:
            dst = self.mapped.get((op.dst_slot, op.dst_page_index), {})
            src = self.mapped.get((op.src_slot, op.src_page_index), {})
            if not dst or set(dst) - set(src):
                raise Refused
            for p, g in dst.items():
                value = self.data.get((src[p], p))
                self.data.pop((g, p), None) if value is None else self.data.__setitem__((g, p), value)
        self.mapped = {s: parts for s, parts in self.mapped.items() if parts}


class HybridPoolMachine(RuleBasedStateMachine):
    mapper = False

    def __init__(self) -> None:
        super().__init__()
        self.driver = FaultInjectingDriver(HostDriver())
        self.cache = hybrid_cache(pool_pages=POOL, driver=self.driver, background_mapper=self.mapper)
        self.shadow = Shadow()

    def member_views(self, slot: int, index: int, part: str) -> list:
        c, pb = self.cache.config, self.cache.page_bytes
        pages = [((2 * layer + kv) * c.max_batch + slot) * self.cache.pages_per_slot + index
                 for layer in LAYERS[part] for kv in (0, 1)]
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
        mapped = sorted((s, p, g) for s, parts in self.shadow.mapped.items() for p, g in parts.items())
        if mapped:
            spot, part, group = data.draw(st.sampled_from(mapped))
            for view in self.member_views(*spot, part):
                view.fill_(value)
            self.shadow.data[(group, part)] = value

    @invariant()
    def matches_the_shadow(self):
        self.cache.wait_for_plan()
        assert self.cache.bound_pages == sum(PAGES[p] for _, p in self.shadow.bound)
        for slot in range(SLOTS):
            expected = {i: parts for (s, i), parts in self.shadow.mapped.items() if s == slot}
            assert self.cache.mapped_parts(slot) == expected
        for (slot, index), parts in self.shadow.mapped.items():
            for part, group in parts.items():
                value = self.shadow.data.get((group, part))
                if value is not None:
                    assert all(bool((v == value).all()) for v in self.member_views(slot, index, part))
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
