"""close() of a range with a tensor view alive (vmem/vrange.py): the copies that keep the view's
bytes are checked against available memory first, as one commit; pages it cannot copy are held
(frozen for the view) until the view dies. It copied every page into fresh memory with no check
(128 MiB with 2 MiB available), and a page whose copy failed went back to the pool while the
view still showed it: the view read the next owner's bytes."""
import pytest

from vmemkv import vmem
from vmemkv.vmem import commits
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.pool import RECORD_BYTES

PLENTY_BYTES = 1 << 40
POOL_RECORDS_BYTES = 4 * RECORD_BYTES   # the 4-page pool's records: committed with its pages


def _closed_under_a_view(driver, page_bytes, monkeypatch, available_bytes):
    """A 4-page pool, 3 pages mapped and filled with 7 under one view; the driver then reports
    ``available_bytes`` and a ledger on a fixed clock; the range closed. Returns what a test
    reads: pool, pages, the view, the ledger and the detach calls close() made."""
    ledger = commits.RecentCommits(clock=lambda: 0.0)   # no window expires: no timing
    monkeypatch.setattr(driver, "recent_commits", ledger)
    pool = vmem.PagePool(driver, 4, page_bytes)
    rng = vmem.VirtualRange(pool, 3 * page_bytes)
    pages = pool.allocate(3)
    for index, page in enumerate(pages):
        rng.map(index, page)
    view = rng.tensor()
    view.fill_(7)
    detached = []
    real_detach = driver.detach
    monkeypatch.setattr(driver, "available_bytes", lambda: available_bytes)
    monkeypatch.setattr(driver, "detach", lambda *a: detached.append(a) or real_detach(*a))
    rng.close()
    return pool, pages, view, ledger, detached


def test_too_little_memory_for_the_copies_commits_none_and_holds_the_pages(
        driver, page_bytes, monkeypatch):
    """The copies need 3 pages, 1 is available: nothing is copied or recorded, the view reads
    its own bytes, the pages reach no next owner until the view dies (CUDA, which cannot
    copy, holds them likewise)."""
    pool, pages, view, ledger, detached = _closed_under_a_view(
        driver, page_bytes, monkeypatch, available_bytes=page_bytes)
    assert detached == [] and ledger.unseen(page_bytes) == 0
    assert (pool.held_pages, pool.mapped_pages, pool.free_pages) == (3, 0, 1)
    other = vmem.VirtualRange(pool, 2 * page_bytes)
    with pytest.raises(vmem.PageStateError, match="held by a tensor view"):
        other.map(0, pages[0])                 # its owner still has it: frozen all the same
    with pytest.raises(vmem.PageStateError, match="held by a tensor view"):
        pool.discard(pages[1])                 # the view would read zeros
    pool.release(pages)                        # accepted, parked
    assert all(pool.is_free(page) for page in pages) and pool.free_pages == 1
    (fresh,) = pool.allocate(1)                # the one page never mapped, and no other
    assert fresh not in pages
    with pytest.raises(vmem.PoolExhaustedError):
        pool.allocate(1)
    with pytest.raises(vmem.PageStateError, match="free"):
        other.map(1, pages[2])
    other.map(0, fresh)
    other.tensor(0, page_bytes).fill_(9)       # the next owner's writes ...
    assert bool(view.eq(7).all())              # ... never show in the view
    view[:8] = 5                               # nor do the view's in the next owner's page
    assert bool(other.tensor(0, page_bytes).eq(9).all())
    pool.check_integrity()
    del view                                   # the last view: the pages come back
    assert (pool.held_pages, pool.free_pages) == (0, 3)
    assert sorted(pool.allocate(3)) == sorted(pages)
    pool.check_integrity()


def test_enough_memory_copies_every_page_records_the_copies_and_gives_them_back(
        monkeypatch):
    """The old behaviour where the copies fit: each page copied, the pages back in the pool
    at once, the next owner's writes never in the view; the copies counted as committed until
    the view dies."""
    driver = vmem.open_driver("host")
    page_bytes = driver.granularity_bytes
    pool, pages, view, ledger, detached = _closed_under_a_view(
        driver, page_bytes, monkeypatch, available_bytes=PLENTY_BYTES)
    assert len(detached) == 3
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES + 4 * page_bytes + 3 * page_bytes
    assert (pool.held_pages, pool.mapped_pages) == (0, 0)
    pool.release(pages)
    assert pool.free_pages == 4
    with vmem.VirtualRange(pool, 4 * page_bytes) as nxt:
        for index, page in enumerate(pool.allocate(4)):    # the same pages, a next owner
            nxt.map(index, page)
        nxt.tensor().fill_(9)
        assert bool(view.eq(7).all())
        for index in range(4):
            nxt.unmap(index)
    del view
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES + 4 * page_bytes  # copies went back
    pool.check_integrity()


def test_a_copy_that_fails_holds_its_page_and_records_only_the_copies_made(monkeypatch):
    """The second page's copy fails (an mmap refused, say): that page stays held, the others,
    copied, go back. It was given back aliased: the next owner's 9s showed in the view."""
    driver = vmem.open_driver("host")
    page_bytes = driver.granularity_bytes
    real_detach = type(driver).detach
    tries = []

    def second_fails(self, *args):
        tries.append(args)
        if len(tries) == 2:
            raise vmem.DriverCallError("detach: mmap failed (injected)")
        return real_detach(self, *args)
    monkeypatch.setattr(type(driver), "detach", second_fails)
    pool, pages, view, ledger, detached = _closed_under_a_view(
        driver, page_bytes, monkeypatch, available_bytes=PLENTY_BYTES)
    assert len(detached) == 3 and pool.held_pages == 1
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES + 4 * page_bytes + 2 * page_bytes
    pool.release(pages)
    with vmem.VirtualRange(pool, 4 * page_bytes) as nxt:
        for index, page in enumerate(pool.allocate(pool.free_pages)):
            nxt.map(index, page)               # every page but the held one
        with pytest.raises(vmem.PageStateError, match="free"):
            nxt.map(3, pages[1])
        nxt.tensor(0, 3 * page_bytes).fill_(9)
        assert bool(view.eq(7).all())
        nxt.unmap(0), nxt.unmap(1), nxt.unmap(2)
    pool.release([page for page in range(4) if page != pages[1]])
    del view
    assert pool.held_pages == 0 and pool.free_pages == 4
    pool.check_integrity()


class _NoDetach(FaultInjectingDriver):
    """A real host driver that cannot detach, as CUDA cannot (Driver.detach's default)."""

    def detach(self, address, handle, page_bytes, copy=True):
        return False


def test_a_driver_that_cannot_detach_holds_every_page_past_the_pools_close(monkeypatch):
    """CUDA's semantics: nothing copied; a pool closed while the view lives destroys the pages,
    whose memory the view's mapping keeps until it dies (commits given back then)."""
    driver = _NoDetach(vmem.open_driver("host"))
    page_bytes = driver.granularity_bytes
    pool, pages, view, ledger, _ = _closed_under_a_view(
        driver, page_bytes, monkeypatch, available_bytes=PLENTY_BYTES)
    assert pool.held_pages == 3
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES + 4 * page_bytes
    pool.release(pages)
    pool.close()                               # refused before only for open ranges' maps
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES + 3 * page_bytes  # the unheld page
    assert bool(view.eq(7).all())
    del view
    assert driver.mapped_addresses == 0     # the records count until the window ends (they
    assert ledger.unseen(PLENTY_BYTES) == POOL_RECORDS_BYTES   # go as the pool dies, not here)
