"""Random reserve/map/unmap/share/write/release/close sequences against a shadow model.

The shadow is plain dicts: which pool pages are allocated, what byte each page holds, and which
page each range maps at each index. After every step the real pool/ranges must agree with it,
counters and contents (read through every mapping) alike. Invalid operations are tried too:
each must raise its typed error and change nothing.
"""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv import vmem

from ..hypothesis_budget import examples
PAGE_BYTES = 4096
NUM_POOL_PAGES = 6
RANGE_PAGES = 5


class VMemMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.driver = vmem.open_driver("host")
        self.pool = vmem.PagePool(self.driver, NUM_POOL_PAGES, PAGE_BYTES)
        self.ranges: list[vmem.VirtualRange] = []
        self.shadow_maps: list[dict[int, int]] = []     # per range: index -> page
        self.shadow_allocated: set[int] = set()
        self.shadow_byte: dict[int, int] = {}            # page -> the byte it is filled with

    # -- helpers --
    def mappings_of(self, page):
        return sum(list(m.values()).count(page) for m in self.shadow_maps)

    def state(self):
        return (self.pool.free_pages, [self.pool.mapping_count(p) for p in range(NUM_POOL_PAGES)],
                [r.mapped_pages() for r in self.ranges])

    # -- rules --
    @precondition(lambda self: len(self.ranges) < 3)
    @rule(num_pages=st.integers(1, RANGE_PAGES))
    def reserve(self, num_pages):
        self.ranges.append(vmem.VirtualRange(self.pool, num_pages * PAGE_BYTES))
        self.shadow_maps.append({})

    @precondition(lambda self: self.ranges)
    @rule(data=st.data())
    def close_range(self, data):
        i = data.draw(st.integers(0, len(self.ranges) - 1))
        self.ranges.pop(i).close()
        self.shadow_maps.pop(i)

    @rule(count=st.integers(1, 3))
    def allocate(self, count):
        free = NUM_POOL_PAGES - len(self.shadow_allocated)
        if count > free:
            before = self.state()
            with pytest.raises(vmem.PoolExhaustedError):
                self.pool.allocate(count)
            assert self.state() == before
            return
        for page in self.pool.allocate(count):
            assert page not in self.shadow_allocated
            self.shadow_allocated.add(page)

    @rule(page=st.integers(0, NUM_POOL_PAGES - 1))
    def release(self, page):
        if page in self.shadow_allocated and self.mappings_of(page) == 0:
            self.pool.release(page)
            self.shadow_allocated.discard(page)
            self.shadow_byte.pop(page, None)
        else:
            before = self.state()
            with pytest.raises(vmem.PageStateError):
                self.pool.release(page)
            assert self.state() == before

    @precondition(lambda self: self.ranges)
    @rule(data=st.data(), page=st.integers(0, NUM_POOL_PAGES - 1))
    def map(self, data, page):
        """Mapping an already-mapped page elsewhere is how sharing happens."""
        i = data.draw(st.integers(0, len(self.ranges) - 1))
        rng, shadow = self.ranges[i], self.shadow_maps[i]
        index = data.draw(st.integers(0, rng.num_pages))  # num_pages itself is out of range
        before = self.state()
        if index >= rng.num_pages:
            with pytest.raises(vmem.PageIndexError):
                rng.map(index, page)
        elif index in shadow:
            with pytest.raises(vmem.AlreadyMappedError):
                rng.map(index, page)
        elif page not in self.shadow_allocated:
            with pytest.raises(vmem.PageStateError):
                rng.map(index, page)
        else:
            rng.map(index, page)
            shadow[index] = page
            return
        assert self.state() == before

    @precondition(lambda self: self.ranges)
    @rule(data=st.data())
    def unmap(self, data):
        i = data.draw(st.integers(0, len(self.ranges) - 1))
        rng, shadow = self.ranges[i], self.shadow_maps[i]
        index = data.draw(st.integers(0, rng.num_pages - 1))
        if index in shadow:
            assert rng.unmap(index) == shadow.pop(index)
        else:
            before = self.state()
            with pytest.raises(vmem.NotMappedError):
                rng.unmap(index)
            assert self.state() == before

    @precondition(lambda self: any(self.shadow_maps))
    @rule(data=st.data(), value=st.integers(0, 255))
    def write(self, data, value):
        i = data.draw(st.sampled_from([k for k, m in enumerate(self.shadow_maps) if m]))
        index = data.draw(st.sampled_from(sorted(self.shadow_maps[i])))
        self.ranges[i].tensor(index * PAGE_BYTES, PAGE_BYTES).fill_(value)
        self.shadow_byte[self.shadow_maps[i][index]] = value

    # -- checks after every step --
    @invariant()
    def counters_match_shadow(self):
        self.pool.check_integrity()
        assert self.pool.free_pages == NUM_POOL_PAGES - len(self.shadow_allocated)
        for page in range(NUM_POOL_PAGES):
            assert self.pool.mapping_count(page) == self.mappings_of(page)
        assert self.pool.mapped_pages == len({p for m in self.shadow_maps for p in m.values()})
        for rng, shadow in zip(self.ranges, self.shadow_maps):
            assert rng.mapped_pages() == shadow

    @invariant()
    def every_mapping_shows_its_pages_bytes(self):
        for rng, shadow in zip(self.ranges, self.shadow_maps):
            for index, page in shadow.items():
                if page in self.shadow_byte:
                    view = rng.tensor(index * PAGE_BYTES, PAGE_BYTES)
                    expected = self.shadow_byte[page]
                    assert view[0].item() == expected and view[-1].item() == expected
                    assert bool((view == expected).all())

    def teardown(self):
        for rng in self.ranges:
            rng.close()
        self.pool.close()


VMemMachine.TestCase.settings = settings(max_examples=examples(300),
                                         stateful_step_count=30, deadline=None)  # long profile: more
TestVMemAgainstShadow = VMemMachine.TestCase
