"""Elastic pages (issue 32) against a shadow: a state machine checks every ``PagePool`` call
(allocate, release, map, unmap, discard, recommit, extend) against a shadow of which ids are
allocated, mapped where, created and discarded, and the byte each created page holds."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vmemkv import vmem
from vmemkv.vmem.host import HostDriver

from ..hypothesis_budget import examples
from .elastic_pages import ElasticDriver, counts


MAX_PAGES, RANGE_PAGES = 10, 4


class ElasticPoolMachine(RuleBasedStateMachine):
    """Shadow: allocated ids, what each range index maps, which ids have memory bound (and how
    many pages were created in all), which are discarded, and the byte each created page holds."""

    @initialize(grow=st.booleans(), num_pages=st.integers(2, 6), taken=st.integers(0, 6))
    def build(self, grow, num_pages, taken):
        self.driver = ElasticDriver(HostDriver())
        self.page = self.driver.granularity_bytes
        self.grow = grow
        self.pool = vmem.PagePool(self.driver, num_pages, self.page, grow=grow)
        self.rng = vmem.VirtualRange(self.pool, RANGE_PAGES * self.page)
        self.total, self.allocated, self.maps = num_pages, set(), {}
        self.bound = set() if grow else set(range(num_pages))
        self.created = 0 if grow else num_pages
        self.discarded, self.byte = set(), {}
        self.allocate(min(taken, num_pages))

    def mapped_ids(self) -> set:
        return set(self.maps.values())

    def state(self):
        return counts(self.pool), self.rng.mapped_pages(), self.driver.memfd_bytes()

    def pick(self, data, candidates, most: int = 3) -> list:
        """1..``most`` ids, mostly from ``candidates`` (a call that should work), one time in
        five with one more added: a mapped or discarded id, or any (often refused)."""
        some = st.sampled_from(sorted(candidates)) if candidates else st.integers(0, MAX_PAGES)
        pages = data.draw(st.lists(some, min_size=1, max_size=most, unique=True))
        if data.draw(st.integers(0, 4)) == 4:
            odd = sorted(self.mapped_ids() | self.discarded)
            pages.append(data.draw(st.integers(0, MAX_PAGES) | st.sampled_from(odd or [0])))
        return pages

    def refused(self, error, call):
        before = self.state()
        with pytest.raises(error):
            call()
        assert self.state() == before

    @rule(count=st.integers(0, 3))
    def allocate(self, count):
        if count > self.total - len(self.allocated):
            return self.refused(vmem.PoolExhaustedError, lambda: self.pool.allocate(count))
        taken = self.pool.allocate(count)
        assert not set(taken) & self.allocated
        self.allocated |= set(taken)

    @rule(data=st.data())
    def release(self, data):
        page = self.pick(data, self.allocated - self.mapped_ids(), most=1)[-1]
        if page not in self.allocated or page in self.mapped_ids():
            return self.refused(vmem.PageStateError, lambda: self.pool.release(page))
        self.pool.release(page)
        self.allocated.discard(page)

    @rule(data=st.data())
    def map(self, data):
        free = sorted(set(range(RANGE_PAGES)) - set(self.maps)) or list(range(RANGE_PAGES))
        index = data.draw(st.sampled_from(free) if data.draw(st.integers(0, 4)) < 4
                          else st.integers(0, RANGE_PAGES - 1))
        page = self.pick(data, self.allocated, most=1)[-1]
        if index in self.maps:
            return self.refused(vmem.AlreadyMappedError, lambda: self.rng.map(index, page))
        if page not in self.allocated:
            return self.refused(vmem.PageStateError, lambda: self.rng.map(index, page))
        self.rng.map(index, page)
        if page not in self.bound:           # on demand: a chunk when the stock is empty
            if self.created == len(self.bound):
                self.created += min(self.total - self.created, max(16, self.created // 4))
            self.bound.add(page)
        if page in self.discarded:           # re-created: zeros
            self.discarded.discard(page)
            self.byte[page] = 0
        self.maps[index] = page
        view = self.rng.tensor(index * self.page, self.page)
        assert int(view[0]) == self.byte.get(page, 0) == int(view[-1])
        self.byte[page] = (page * 37 + index + 1) % 256
        view.fill_(self.byte[page])

    @rule(index=st.integers(0, RANGE_PAGES - 1))
    def unmap(self, index):
        if index not in self.maps:
            return self.refused(vmem.NotMappedError, lambda: self.rng.unmap(index))
        assert self.rng.unmap(index) == self.maps.pop(index)

    @rule(data=st.data())
    def discard(self, data):
        pages = self.pick(data, self.bound - self.discarded - self.mapped_ids())
        ok = len(set(pages)) == len(pages) and all(
            p in self.bound and p not in self.discarded and p not in self.mapped_ids()
            for p in pages)
        if not ok:
            return self.refused(vmem.PageStateError, lambda: self.pool.discard(pages))
        self.pool.discard(pages)
        self.discarded |= set(pages)

    @rule(data=st.data())
    def recommit(self, data):
        pages = self.pick(data, self.discarded)
        if len(set(pages)) != len(pages) or not set(pages) <= self.discarded:
            return self.refused(vmem.PageStateError, lambda: self.pool.recommit(pages))
        self.pool.recommit(pages)
        self.discarded -= set(pages)
        self.byte.update((p, 0) for p in pages)

    @precondition(lambda self: self.total < MAX_PAGES)
    @rule(count=st.integers(0, 2))
    def extend(self, count):
        count = min(count, MAX_PAGES - self.total)
        assert self.pool.extend(count) == list(range(self.total, self.total + count))
        if not self.grow:
            self.bound |= set(range(self.total, self.total + count))
            self.created += count
        self.total += count

    @invariant()
    def pool_agrees_with_the_shadow(self):
        committed = self.created - len(self.discarded)
        assert self.pool.total_pages == self.total
        assert self.pool.free_pages == self.total - len(self.allocated)
        assert self.pool.committed_pages == committed and self.pool.discarded_pages == len(
            self.discarded)
        assert self.driver.memfd_bytes() == committed * self.page
        assert self.rng.mapped_pages() == self.maps
        assert self.pool.mapped_pages == len(self.mapped_ids())
        self.pool.check_integrity()

    def teardown(self):
        self.rng.close()
        self.pool.release(sorted(self.allocated))
        self.pool.close()
        self.driver.close()


ElasticPoolMachine.TestCase.settings = settings(max_examples=examples(60),
                                                stateful_step_count=30, deadline=None)
TestElasticPoolAgainstShadow = ElasticPoolMachine.TestCase
