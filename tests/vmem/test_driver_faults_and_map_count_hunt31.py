"""Hunt 31, vmem: the host driver's map-count headroom at close() under a view; the fault
injecting driver behaving as the driver it wraps (undo of a map, fault counting, the memory
ledger), and a fault at any call against a shadow model; CUDA's unmap_if_mapped raising a
failed synchronise."""
import gc

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmemkv import vmem
from vmemkv.vmem import commits, map_count
from vmemkv.vmem.faults import FAULT_KINDS, FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..hypothesis_budget import examples

MERGED_PAGES = 600       # mapped in memfd order: one mapping of the process, not 600
MARGIN = 200             # mappings the patched limit leaves above the headroom
SLACK = 50               # what torch and Python may map meanwhile


def test_close_under_a_view_keeps_the_map_count_headroom_and_holds_the_rest(monkeypatch):
    """Each page copied at close() is a mapping of its own (copies never merge): n merged pages
    became n mappings, past the headroom for a large range (70,000 4 KiB pages left the process
    3 mappings short of the real limit, where malloc and unmaps fail). Copies stop at the
    headroom; the pages left are held, untried after two refusals (each refusal counts the
    process's mappings: minutes for a large range), and the view reads every byte it held."""
    limit = map_count.mapping_count() + map_count.MIN_HEADROOM + MARGIN
    monkeypatch.setattr(map_count, "max_map_count", lambda: limit)
    monkeypatch.setattr(map_count, "GUARD", map_count.MapCountGuard())
    driver = vmem.open_driver("host")
    page = driver.granularity_bytes
    pool = vmem.PagePool(driver, MERGED_PAGES, page)
    rng = vmem.VirtualRange(pool, MERGED_PAGES * page)
    for index, page_id in enumerate(pool.allocate(MERGED_PAGES)):
        rng.map(index, page_id)
    view = rng.tensor().view(MERGED_PAGES, page)
    expected = (torch.arange(MERGED_PAGES) % 251 + 1).to(torch.uint8)
    view[:, 0] = expected
    tries = []
    real_detach = driver.detach
    monkeypatch.setattr(driver, "detach", lambda *args: tries.append(args) or real_detach(*args))
    rng.close()
    assert map_count.mapping_count() <= limit - map_count.headroom(limit) + SLACK
    assert 0 < pool.held_pages < MERGED_PAGES       # some copied, the rest held
    assert len(tries) == MERGED_PAGES - pool.held_pages + 2
    assert torch.equal(view[:, 0], expected)
    del view
    gc.collect()
    assert pool.held_pages == 0 and pool.mapped_pages == 0
    pool.check_integrity()
    pool.close()


@pytest.fixture
def faulty():
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    page = driver.granularity_bytes
    pool = vmem.PagePool(driver, 2, page)
    rng = vmem.VirtualRange(pool, 2 * page)
    (page_id,) = pool.allocate(1)
    yield driver, pool, rng, page_id
    driver.disarm()
    rng.close()
    pool.close()


def test_an_injected_unmap_fault_in_undo_map_is_raised_not_taken_for_nothing_mapped(faulty):
    """A map the driver made but the range never recorded (an interrupt between them) is undone
    by ``undo_map`` through ``unmap_if_mapped``; an injected fault there returned False, the
    mapping stayed, and the index could never be mapped again (AlreadyMappedError)."""
    driver, pool, rng, page_id = faulty
    page = driver.granularity_bytes
    driver.map(rng.address, pool._handle_of(page_id), page)   # the interrupted map's half
    driver.fail_at("unmap", 0)
    with pytest.raises(vmem.DriverCallError, match="injected fault"):
        rng.undo_map(0)
    assert driver.mapped_addresses == 1            # as it was: the failed call changed nothing
    rng.undo_map(0)                                # the fault was one call: now undone
    assert driver.mapped_addresses == 0
    rng.map(0, page_id)
    assert rng.page_at(0) == page_id and pool.mapping_count(page_id) == 1


def test_unmap_if_mapped_of_nothing_counts_no_unmap_and_uses_up_no_fault(faulty):
    """An address with nothing mapped made no unmap call; the default counted one and an armed
    fault fired there, swallowed, so the unmap it was armed for went through unfaulted."""
    driver, pool, rng, page_id = faulty
    page = driver.granularity_bytes
    driver.fail_at("unmap", 0)
    assert driver.unmap_if_mapped(rng.address, page) is False
    assert driver.calls["unmap"] == 0 and driver.faults_raised["unmap"] == 0
    rng.map(0, page_id)
    with pytest.raises(vmem.DriverCallError, match="injected fault at call 0"):
        rng.unmap(0)
    assert rng.page_at(0) == page_id


class _LaggingHost(HostDriver):
    """A host whose available-memory reading never shows what was committed (MemAvailable's
    lag, for as long as the test runs), with a ledger of its own."""

    AVAILABLE_PAGES = 64

    def __init__(self):
        super().__init__()
        self.recent_commits = commits.RecentCommits()

    def available_bytes(self):
        return self.AVAILABLE_PAGES * self.granularity_bytes


def test_a_pool_through_the_fault_injector_counts_in_the_wrapped_drivers_ledger():
    """The wrapper had a ledger of its own: a pool built through it and one built on the bare
    driver right after both passed against the same memory."""
    inner = _LaggingHost()
    page = inner.granularity_bytes
    wrapped = FaultInjectingDriver(inner)
    assert wrapped.recent_commits is inner.recent_commits
    first = vmem.PagePool(wrapped, 40, page)
    with pytest.raises(vmem.InsufficientMemoryError, match="not shown yet"):
        vmem.PagePool(inner, 40, page)
    first.close()


# -- a fault at any call, against a shadow model --------------------------------------------
NUM_POOL_PAGES, RANGE_PAGES = 5, 4


class FaultAtAnyCallMachine(RuleBasedStateMachine):
    """Each rule may run with one injected fault armed on any driver call kind: a call the fault
    stops raises DriverCallError and leaves the pool and every range as they were (counters,
    mappings, committed and discarded pages); a call it does not reach behaves as the shadow
    says. Every mapping shows its page's bytes throughout."""

    def __init__(self):
        super().__init__()
        self.driver = FaultInjectingDriver(vmem.open_driver("host"))
        self.page = self.driver.granularity_bytes
        self.pool = vmem.PagePool(self.driver, NUM_POOL_PAGES, self.page)
        self.ranges = [vmem.VirtualRange(self.pool, RANGE_PAGES * self.page) for _ in range(2)]
        self.maps = [{}, {}]                     # per range: index -> pool page
        self.allocated, self.discarded = set(), set()
        self.byte = dict.fromkeys(range(NUM_POOL_PAGES), 0)

    def state(self):
        pool = self.pool
        return (pool.free_pages, pool.mapped_pages, pool.committed_pages, pool.discarded_pages,
                [r.mapped_pages() for r in self.ranges], self.driver.mapped_addresses)

    def run(self, data, call):
        """``call()`` with a fault armed (or none); True when it ran, False when the fault
        stopped it, after checking it changed nothing."""
        kind = data.draw(st.sampled_from((None,) + FAULT_KINDS))
        if kind is not None:
            self.driver.fail_at(kind, data.draw(st.integers(0, 1)))
        before = self.state()
        try:
            call()
        except vmem.DriverCallError as error:
            assert "injected fault" in str(error)
            assert self.state() == before
            return False
        finally:
            self.driver.disarm()
        return True

    def mapped(self, page_id):
        return any(page_id in m.values() for m in self.maps)

    @rule(data=st.data(), count=st.integers(1, 2))
    def allocate(self, data, count):
        if count <= NUM_POOL_PAGES - len(self.allocated):
            taken = []
            assert self.run(data, lambda: taken.extend(self.pool.allocate(count)))
            self.allocated.update(taken)

    @rule(data=st.data())
    def release(self, data):
        free_to_go = sorted(p for p in self.allocated if not self.mapped(p))
        if free_to_go:
            page_id = data.draw(st.sampled_from(free_to_go))
            assert self.run(data, lambda: self.pool.release(page_id))
            self.allocated.discard(page_id)

    @rule(data=st.data(), which=st.integers(0, 1), index=st.integers(0, RANGE_PAGES - 1))
    def map(self, data, which, index):
        if index in self.maps[which] or not self.allocated:
            return
        page_id = data.draw(st.sampled_from(sorted(self.allocated)))
        if self.run(data, lambda: self.ranges[which].map(index, page_id)):
            self.maps[which][index] = page_id
            if page_id in self.discarded:            # re-created: zeros on the host
                self.discarded.discard(page_id)
                self.byte[page_id] = 0

    @rule(data=st.data(), which=st.integers(0, 1), index=st.integers(0, RANGE_PAGES - 1))
    def unmap(self, data, which, index):
        if index in self.maps[which] and self.run(data, lambda: self.ranges[which].unmap(index)):
            del self.maps[which][index]

    @rule(data=st.data(), which=st.integers(0, 1), value=st.integers(1, 255))
    def write(self, data, which, value):
        if self.maps[which]:
            index = data.draw(st.sampled_from(sorted(self.maps[which])))
            self.ranges[which].tensor(index * self.page, self.page).fill_(value)
            self.byte[self.maps[which][index]] = value

    @rule(data=st.data(), which=st.integers(0, 1))
    def copy_page(self, data, which):
        if len(self.maps[which]) >= 2:
            dst, src = data.draw(st.permutations(sorted(self.maps[which])))[:2]
            if self.run(data, lambda: self.ranges[which].copy_page(dst, src)):
                self.byte[self.maps[which][dst]] = self.byte[self.maps[which][src]]

    @rule(data=st.data())
    def discard(self, data):
        candidates = sorted(p for p in range(NUM_POOL_PAGES)
                            if not self.mapped(p) and p not in self.discarded)
        if candidates:
            page_id = data.draw(st.sampled_from(candidates))
            if self.run(data, lambda: self.pool.discard(page_id)):
                self.discarded.add(page_id)
                self.byte[page_id] = None            # its bytes are lost

    @rule(data=st.data())
    def recommit(self, data):
        if self.discarded:
            page_id = data.draw(st.sampled_from(sorted(self.discarded)))
            if self.run(data, lambda: self.pool.recommit(page_id)):
                self.discarded.discard(page_id)
                self.byte[page_id] = 0               # the host re-creates zeros

    @invariant()
    def pool_and_ranges_agree_with_the_shadow(self):
        self.pool.check_integrity()
        assert self.pool.free_pages == NUM_POOL_PAGES - len(self.allocated)
        assert self.pool.discarded_pages == len(self.discarded)
        assert self.pool.committed_pages == NUM_POOL_PAGES - len(self.discarded)
        for rng, shadow in zip(self.ranges, self.maps):
            assert rng.mapped_pages() == shadow
            for index, page_id in shadow.items():
                row = rng.tensor(index * self.page, self.page)
                assert int(row[0]) == int(row[-1]) == self.byte[page_id]

    def teardown(self):
        for rng in self.ranges:
            rng.close()
        self.pool.close()


FaultAtAnyCallMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None)
TestFaultAtAnyCallAgainstShadow = FaultAtAnyCallMachine.TestCase


def test_cuda_unmap_if_mapped_raises_a_failed_synchronise_and_is_false_only_for_a_refused_unmap():
    """CudaDriver took any failure of ``unmap`` for "nothing mapped": a synchronise failing
    before cuMemUnmap (a sticky error) returned False with the page still mapped, so an undone
    map stayed mapped. Checked through the real bindings with a stand-in for libcuda."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the stand-in would reach the real driver")
    from .test_cuda_contract import GRANULARITY, LibcudaStandIn, bound_driver
    stand_in = LibcudaStandIn(fail={
        "cuCtxSynchronize": (cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, 1),
        "cuMemUnmap": (cu.CUresult.CUDA_ERROR_INVALID_VALUE, 2)})
    driver = bound_driver(stand_in)
    address = driver.reserve(2 * GRANULARITY)
    (handle,) = driver.create_pages(1, GRANULARITY)
    driver.map(address, handle, GRANULARITY)
    with pytest.raises(vmem.DriverCallError, match="cuCtxSynchronize.*ILLEGAL_ADDRESS"):
        driver.unmap_if_mapped(address, GRANULARITY)
    assert "cuMemUnmap" not in stand_in.calls                # still mapped: it said so
    assert driver.unmap_if_mapped(address, GRANULARITY) is True
    assert driver.unmap_if_mapped(address, GRANULARITY) is False    # refused: nothing there
    assert stand_in.calls.count("cuMemUnmap") == 2
