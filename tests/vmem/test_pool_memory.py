"""PagePool against the device's memory: refused before any page when the budget exceeds what is
available, pages created on first mapping with ``grow=True`` (never more than the budget, every
growth checked), and ``release`` taking what ``allocate`` returns (all or none)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmemkv import vmem
from vmemkv.vmem.commits import RecentCommits
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver
from vmemkv.vmem.pool import RECORD_BYTES

MiB = 1 << 20


class LowMemoryDriver(FaultInjectingDriver):
    """A real driver that reports ``available`` bytes (the machine is untouched)."""

    def __init__(self, inner, available: int) -> None:
        super().__init__(inner)
        self.available = available

    def available_bytes(self):
        return self.available


@pytest.mark.parametrize("grow", [False, True], ids=["eager", "on-demand"])
def test_a_pool_above_available_memory_is_refused_before_any_page(grow):
    driver = FaultInjectingDriver(HostDriver())
    if grow:   # on demand, the refusal comes at the first page past what is available
        driver = LowMemoryDriver(HostDriver(), available=1 * MiB)
    with pytest.raises(vmem.InsufficientMemoryError) as info:
        pool = vmem.PagePool(driver, 10**6, 2 * MiB, grow=grow)
        rng = vmem.VirtualRange(pool, 2 * MiB)
        rng.map(0, pool.allocate(1)[0])
    assert isinstance(info.value, MemoryError)
    message = str(info.value)
    if grow:   # the 16-page chunk did not fit, nor did the page alone
        assert "1 pages of 2097152 bytes" in message and "1048576 bytes" in message
    else:
        assert "1000000 pages of 2097152 bytes" in message and str(10**6 * 2 * MiB) in message
    assert "available" in message
    assert driver.calls["create_pages"] == 0
    if grow:
        assert pool.committed_pages == 0 and not rng.mapped_pages()
        rng.close()
        pool.release(0)
        pool.close()


def test_a_growth_chunk_that_does_not_fit_creates_the_page_alone():
    """On demand, a first mapping creates a chunk of 16 pages; with room for three it was
    refused ("creating 16 pages ... ask for fewer pages", for one page asked); now the page
    alone is created, and only a page that does not fit is refused."""
    driver = LowMemoryDriver(HostDriver(), available=3 * 2 * MiB)
    with vmem.PagePool(driver, 64, 2 * MiB, grow=True) as pool, \
            vmem.VirtualRange(pool, 2 * MiB) as rng:
        page = pool.allocate(1)[0]
        rng.map(0, page)
        assert pool.committed_pages == 1 and rng.is_mapped(0)
        rng.unmap(0)
        pool.release(page)


@pytest.mark.parametrize("committed", [None, 0], ids=["eager", "discarded"])
def test_a_pool_is_refused_before_its_records_are_built(committed):
    """The pool keeps a few hundred bytes of host records a page (its id's slot, free-list
    entry and counters) whatever the driver: they were built, a list of ``num_pages`` at a
    time, before the pages' memory was checked, so a pool of 10**10 4 KiB pages took about 80
    GB before its refusal (or a MemoryError, or the OOM killer), and a discarded one was never
    checked. Both are refused now with nothing built: tracemalloc sees under 1 MiB."""
    import tracemalloc
    driver = FaultInjectingDriver(HostDriver())
    tracemalloc.start()
    try:
        with pytest.raises(vmem.InsufficientMemoryError, match="a pool of 10000000000 pages "
                                                             "keeps about 5120000000000 bytes"):
            vmem.PagePool(driver, 10**10, 4096, committed_pages=committed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB and driver.calls["create_pages"] == 0


def test_extending_a_pool_checks_the_new_records_first():
    """``extend(10**8)`` on a one-page pool built its lists first (856 MiB, then a bare
    MemoryError under a ulimit; without one it kept allocating): refused as a new pool is."""
    import tracemalloc
    with vmem.PagePool(HostDriver(), 1, 4096, grow=True) as pool:
        tracemalloc.start()
        try:
            with pytest.raises(vmem.InsufficientMemoryError, match="a pool of 10000000000 pages"):
                pool.extend(10**10)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < MiB and pool.total_pages == 1
        for bad in (True, None, 1.0):       # True was page 1; None and 1.0 a raw TypeError
            with pytest.raises(vmem.PageStateError):
                pool.release(bad)


def test_an_on_demand_pool_commits_nothing_until_a_page_is_mapped():
    driver = FaultInjectingDriver(HostDriver())
    page = driver.granularity_bytes
    with vmem.PagePool(driver, 1000, page, grow=True) as pool:
        ids = pool.allocate(1000)
        assert pool.committed_bytes == 0 and driver.calls["create_pages"] == 0
        rng = vmem.VirtualRange(pool, 2 * page)
        rng.map(0, ids[500])
        assert pool.committed_pages == 16 and driver.calls["create_pages"] == 1
        rng.close()
        pool.release(ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 199), st.integers(0, 7)), min_size=1, max_size=60))
def test_on_demand_pages_keep_their_bytes_and_never_exceed_the_budget(mappings):
    """Shadow: the bytes last written through a page id, wherever it was mapped."""
    driver = HostDriver()
    page = driver.granularity_bytes
    pool = vmem.PagePool(driver, 200, page, grow=True)
    ids = pool.allocate(200)
    rng = vmem.VirtualRange(pool, 8 * page)
    shadow, ever = {}, set()
    for value, (page_id, index) in enumerate(mappings):
        if rng.page_at(index) is not None:
            rng.unmap(index)
        rng.map(index, ids[page_id])
        ever.add(page_id)
        view = rng.tensor(index * page, page, torch.uint8)
        if page_id in shadow:
            assert int(view[0]) == shadow[page_id]        # same physical page as before
        view[0] = shadow[page_id] = value % 256
        # created only on first mapping, in chunks of max(16, committed / 4), up to the budget
        assert len(ever) <= pool.committed_pages <= min(200, len(ever) + max(16, len(ever) // 3))
        pool.check_integrity()
    rng.close()
    pool.release(ids)
    pool.close()


def test_release_takes_what_allocate_returns_all_or_none():
    driver = HostDriver()
    page = driver.granularity_bytes
    with vmem.PagePool(driver, 4, page) as pool:
        pool.release(pool.allocate(3))
        assert pool.free_pages == 4
        pages = pool.allocate(2)
        rng = vmem.VirtualRange(pool, page)
        rng.map(0, pages[1])
        with pytest.raises(vmem.PageStateError, match=f"page {pages[1]} is still mapped"):
            pool.release(pages)
        assert pool.free_pages == 2                     # nothing released
        with pytest.raises(vmem.PageStateError, match="twice"):
            pool.release([pages[0], pages[0]])
        assert pool.free_pages == 2
        rng.close()
        pool.release(pages)
        assert pool.free_pages == 4
        pool.check_integrity()


class MeteredDriver(FaultInjectingDriver):
    """A real driver whose available memory is ``reading`` bytes: set by the test (a reading
    that lags), or, with ``exact``, ``reading`` less what it created so far (no lag). Its
    recent commits run on the test's clock ``now``."""

    def __init__(self, reading: int, exact: bool = False) -> None:
        super().__init__(HostDriver())
        self.reading, self.exact, self.created, self.now = reading, exact, 0, 0.0
        self.recent_commits = RecentCommits(window_s=5.0, clock=lambda: self.now)
        self.hold = None            # an Event the first create_pages waits on

    def available_bytes(self):
        return self.reading - (self.created if self.exact else 0)

    def create_pages(self, num_pages, page_bytes, discarded=False):
        hold, self.hold = self.hold, None
        if hold is not None:
            self.creating.set()
            hold.wait(timeout=5)
        handles = super().create_pages(num_pages, page_bytes, discarded)
        self.created += num_pages * page_bytes
        return handles


def test_two_pools_created_at_once_never_both_pass_against_the_same_memory():
    """Each pool read the available memory, then committed, with nothing between two pools: the
    second read the memory the first was committing and passed too. Reading, check and commit
    are one step under a process-wide lock now: the second reads what the first left."""
    import threading
    page = 64 * 1024
    driver = MeteredDriver(reading=4 * page, exact=True)
    driver.hold, driver.creating = threading.Event(), threading.Event()
    hold, pools, refused = driver.hold, [], []

    def build():
        try:
            pools.append(vmem.PagePool(driver, 3, page))
        except vmem.InsufficientMemoryError as error:
            refused.append(str(error))
    first, second = threading.Thread(target=build), threading.Thread(target=build)
    first.start()
    assert driver.creating.wait(timeout=5)     # the first is committing its 3 pages
    second.start()
    second.join(timeout=0.3)                   # before: it passed and committed meanwhile
    hold.set()
    first.join(), second.join()
    assert len(pools) == 1 and driver.created == 3 * page
    assert refused and f"reports only {page} bytes" in refused[0]
    pools[0].close()


def test_a_pool_right_after_another_counts_what_the_reading_does_not_show_yet():
    """MemAvailable lags a large memfd commit, so a pool created right after another passed
    against memory the first had taken. The commits of the last few seconds count until the
    reading drops by them; pages given back stop counting. A pool's records (heap) count with
    its pages, and show in the reading at once: never taken for its pages seen."""
    page, records = 64 * 1024, RECORD_BYTES     # a page, its records
    driver = MeteredDriver(reading=4 * (page + records))   # a reading that shows nothing yet
    first = vmem.PagePool(driver, 3, page)
    with pytest.raises(vmem.InsufficientMemoryError, match=f"{3 * (page + records)} bytes of "
                                                          f"it committed by this process in "
                                                          f"the last 5 s"):
        vmem.PagePool(driver, 2, page)
    driver.reading -= 3 * records + 2 * page   # it shows the records, two of the three pages
    with pytest.raises(vmem.InsufficientMemoryError, match=f" {page} bytes of it committed"):
        vmem.PagePool(driver, 2, page)
    vmem.PagePool(driver, 1, page).close()     # what is left: one page and its records
    first.close()                              # given back: the pages count no more, ...
    driver.reading = 4 * (page + records)
    with pytest.raises(vmem.InsufficientMemoryError, match=f" {4 * records} bytes of it"):
        vmem.PagePool(driver, 4, page)         # ... the records (gone with the pools) until
    driver.now += 6                            # the window ends
    second = vmem.PagePool(driver, 4, page)
    driver.now += 6                            # past the window: the reading is trusted
    vmem.PagePool(driver, 4, page).close()
    second.close()


def test_bytes_given_back_while_the_commit_lock_is_held_never_wait_for_it():
    # a view's deleter, run by the collector inside Driver.commit on the same thread (reading
    # MemAvailable allocates), waited for the lock that thread held: the process hung (CI did)
    import threading

    from vmemkv.vmem import commits
    ledger = RecentCommits(window_s=5.0, clock=lambda: 0.0)
    ledger.committed(4096, available_before=1 << 20)
    done = threading.Event()
    with commits.LOCK:
        worker = threading.Thread(target=lambda: (ledger.released(4096), done.set()))
        worker.start()
        finished = done.wait(30)     # microseconds when it does not wait; forever when it does
    worker.join()
    assert finished
    assert ledger.unseen(available=1 << 20) == 0    # forgotten at the next reading
