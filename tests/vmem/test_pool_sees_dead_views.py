"""A view's death reaches every call of its pool (vmem/commits.py DrainingLock): one dying while
another thread held the pool's lock was queued and counted only at the next call of a *range*,
so pool-only calls (free_pages, held_pages, allocate, check_integrity) reported its pages held
until some range call came, or forever; one dying inside a pool call on the same thread (the
collector) ran in the middle of that call, which then acted on what it had read before.
And a held page of a closed range stays out of every other range's reach while anything
derived from the view (a slice, a numpy array, a DLPack import) keeps its storage alive."""
import threading

import numpy as np
import pytest
import torch

from vmemkv import vmem
from vmemkv.vmem import commits
from vmemkv.vmem.host import HostDriver
from vmemkv.vmem.pool import RECORD_BYTES

PAGE = 4096
PLENTY_BYTES = 1 << 40
JOIN_S = 60.0        # never reached when the deleter does not wait; only bounds a regression


class _HookedHost(HostDriver):
    """A host driver that runs ``during[kind]`` once inside its next ``kind`` call (a pool call
    holding the pool's lock) and, as CUDA's, cannot detach a page: a range closed under a view
    holds its pages. Its ledger's clock is fixed and it reports plenty of memory, so the ledger
    forgets nothing during a test."""

    def __init__(self) -> None:
        super().__init__()
        self.recent_commits = commits.RecentCommits(clock=lambda: 0.0)
        self.during: dict = {}

    def available_bytes(self):
        return PLENTY_BYTES

    def detach(self, address, handle, page_bytes, copy=True):
        return False

    def discard_pages(self, handles, page_bytes):
        self._run_hook("discard_pages")
        super().discard_pages(handles, page_bytes)

    def release_pages(self, handles, discarded=()):
        self._run_hook("release_pages")
        super().release_pages(handles, discarded)

    def _run_hook(self, kind: str) -> None:
        hook = self.during.pop(kind, None)
        if hook is not None:
            hook()


def _held_under_a_view(num_pages: int):
    """A pool of ``num_pages``; a page mapped in a range, written 7 under a view, and the range
    closed: the page is held for the view. Returns driver, pool, page and a list holding the
    view (clear it to drop the view)."""
    driver = _HookedHost()
    pool = vmem.PagePool(driver, num_pages, PAGE)
    rng = vmem.VirtualRange(pool, PAGE)
    (page,) = pool.allocate(1)
    rng.map(0, page)
    views = [rng.tensor()]
    views[0].fill_(7)
    rng.close()
    assert pool.held_pages == 1
    return driver, pool, page, views


def _drop_on_another_thread(views: list) -> None:
    worker = threading.Thread(target=views.clear)
    worker.start()
    worker.join(JOIN_S)
    assert not worker.is_alive(), "the view's deleter waited for the pool's lock"


def test_a_view_dying_on_another_thread_during_a_pool_call_is_seen_by_the_next_pool_call():
    driver, pool, page, views = _held_under_a_view(num_pages=3)
    pool.release(page)                         # parked until the view dies
    (spare,) = pool.allocate(1)
    assert (pool.held_pages, pool.free_pages) == (1, 1)
    driver.during["discard_pages"] = lambda: _drop_on_another_thread(views)
    pool.discard(spare)                        # holds the lock while the view dies
    assert views == []
    assert (pool.held_pages, pool.free_pages, pool.allocated_pages) == (0, 2, 1)
    assert pool.is_free(page)
    assert sorted(pool.allocate(2)) == sorted({0, 1, 2} - {spare})
    pool.check_integrity()
    pool.close()


def test_a_view_dying_inside_a_pool_call_on_its_own_thread_is_counted_after_the_call():
    """The view dies inside pool.close() (between the close reading which pages are held and
    giving the others back). Run there, its range gave its page back to a pool not yet closed
    (so not to the ledger) while close() still counted it held (nor did it): one page's bytes
    stayed counted as committed. Run as close() returns, every page's bytes go back once."""
    driver, pool, page, views = _held_under_a_view(num_pages=3)
    ledger = driver.recent_commits
    assert ledger.unseen(PLENTY_BYTES) == 3 * PAGE + 3 * RECORD_BYTES
    driver.during["release_pages"] = views.clear
    pool.close()
    assert views == [] and pool.held_pages == 0
    assert ledger.unseen(PLENTY_BYTES) == 3 * RECORD_BYTES   # every page given back, once


def test_views_of_one_range_dying_on_many_threads_while_the_lock_is_held_are_each_counted_once():
    driver = _HookedHost()
    pool = vmem.PagePool(driver, 2, PAGE)
    rng = vmem.VirtualRange(pool, 2 * PAGE)
    rng.map(0, pool.allocate(1)[0])
    views = [rng.tensor(0, PAGE) for _ in range(8)]
    assert rng.live_views == 8
    (spare,) = pool.allocate(1)

    def drop_each_on_its_own_thread() -> None:
        threads = [threading.Thread(target=views.pop) for _ in range(len(views))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in threads)
    driver.during["discard_pages"] = drop_each_on_its_own_thread
    pool.discard(spare)
    assert views == [] and rng.live_views == 0
    rng.close()                                # no view: unmapped, nothing held
    assert (pool.held_pages, pool.mapped_pages, pool.free_pages) == (0, 0, 0)
    pool.check_integrity()


@pytest.mark.parametrize("derive", [
    lambda view: view[:16],
    lambda view: view.numpy(),
    lambda view: torch.from_dlpack(view),
    lambda view: np.from_dlpack(view),
], ids=["slice", "numpy", "torch-dlpack", "numpy-dlpack"])
def test_a_held_page_reaches_no_other_range_while_anything_derived_from_its_view_lives(derive):
    """Not a bug found: the held page stays frozen for whatever keeps the view's storage."""
    driver, pool, page, views = _held_under_a_view(num_pages=2)
    derived = derive(views.pop())              # the view itself is gone; what it made is not
    assert pool.held_pages == 1
    pool.release(page)
    other = vmem.VirtualRange(pool, 2 * PAGE)
    (fresh,) = pool.allocate(pool.free_pages)  # the never-mapped page, and no other
    assert fresh != page
    with pytest.raises(vmem.PageStateError, match="free"):
        other.map(1, page)
    other.map(0, fresh)
    other.tensor(0, PAGE).fill_(9)
    assert int(np.asarray(derived).min()) == int(np.asarray(derived).max()) == 7
    del derived
    assert (pool.held_pages, pool.free_pages) == (0, 1)
    assert pool.allocate(1) == [page]
    pool.check_integrity()
