"""vmem bugs a hunt reproduced (/tmp/hunt_vmem): a view's deleter that waited for the pool's
lock hung the process (lock-order inversion with the commit lock); undo_unmap over another page
unmapped it at the driver and left the range recording it (a read segfaulted); a map the driver
refused still re-created the discarded page; a bad tensor dtype or shape was a bare TypeError."""
import threading

import pytest
import torch

from vmemkv import vmem
from vmemkv.vmem import commits
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.pool import MIN_GROWTH_PAGES

from .forking import child_result, in_child

PAGE = 4096
JOIN_S = 60.0        # never reached when the deleter does not wait; only bounds a regression


def _drop_in_another_thread_while_the_pool_lock_is_held(pool, views: list) -> bool:
    """Drop every view of ``views`` on a second thread while this one holds ``pool``'s lock
    (the collector runs a deleter on whatever thread allocates, under whatever locks it holds):
    whether the drop returned without the lock being given up."""
    worker = threading.Thread(target=views.clear)
    with pool._lock:
        worker.start()
        worker.join(JOIN_S)
        returned = not worker.is_alive()
    worker.join()
    return returned


def test_a_view_dying_while_another_thread_holds_the_pool_lock_never_waits_and_counts_once():
    pool = vmem.PagePool(vmem.open_driver("host"), 2, PAGE)
    rng = vmem.VirtualRange(pool, 2 * PAGE)
    rng.map(0, pool.allocate(1)[0])
    views = [rng.tensor(0, PAGE)]
    assert rng.live_views == 1
    assert _drop_in_another_thread_while_the_pool_lock_is_held(pool, views)
    assert rng.live_views == 0             # counted at the next call, exactly once
    rng.close()
    pool.check_integrity()
    pool.close()


def test_the_last_view_of_a_closed_range_dying_under_a_held_lock_frees_it_at_the_next_call(
        monkeypatch):
    """Too little memory to copy: close() holds the pages for the view. Its deleter, queued
    while another thread held the lock, gives them back at the next call of another range."""
    driver = vmem.open_driver("host")
    monkeypatch.setattr(driver, "recent_commits", commits.RecentCommits(clock=lambda: 0.0))
    pool = vmem.PagePool(driver, 3, PAGE)
    rng, other = vmem.VirtualRange(pool, 2 * PAGE), vmem.VirtualRange(pool, PAGE)
    pages = pool.allocate(2)
    for index, page in enumerate(pages):
        rng.map(index, page)
    views = [rng.tensor()]
    monkeypatch.setattr(driver, "available_bytes", lambda: PAGE)    # 2 copies do not fit
    rng.close()
    pool.release(pages)                    # parked until the view dies
    assert (pool.held_pages, pool.free_pages) == (2, 1)
    assert _drop_in_another_thread_while_the_pool_lock_is_held(pool, views)
    assert other.page_at(0) is None        # any call of the pool's ranges counts it
    assert (pool.held_pages, pool.free_pages) == (0, 3)
    pool.check_integrity()
    other.close()
    pool.close()


def test_views_given_back_while_the_commit_lock_is_held_are_forgotten_at_the_next_reading():
    """RecentCommits shares the deferral (commits.Deferred): queued, then forgotten once."""
    ledger = commits.RecentCommits(clock=lambda: 0.0)
    ledger.committed(3 * PAGE, available_before=1 << 20)
    with commits.LOCK:
        ledger.released(PAGE)
        ledger.released(PAGE)
    assert ledger.unseen(available=1 << 20) == PAGE


def test_undo_unmap_over_another_page_is_refused_before_any_driver_call_and_changes_nothing():
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 4, PAGE)
    rng = vmem.VirtualRange(pool, 4 * PAGE)
    p, q = pool.allocate(2)
    rng.map(0, p)
    rng.unmap(0)
    rng.map(0, q)
    view = rng.tensor(0, PAGE)
    view.fill_(5)
    with pytest.raises(vmem.AlreadyMappedError, match=f"pool page {q} is mapped there now"):
        rng.undo_unmap(0, p)
    # read in a child first: the index was unmapped at the driver, and the read segfaulted
    assert child_result(*in_child(lambda: int(view.sum()))) == repr(5 * PAGE)
    assert (rng.page_at(0), pool.mapping_count(q), pool.mapping_count(p)) == (q, 1, 0)
    assert int(view.sum()) == 5 * PAGE
    del view
    assert rng.unmap(0) == q               # was refused: the driver had nothing there
    rng.close()
    pool.release([p, q])
    pool.check_integrity()
    pool.close()


def test_a_map_the_driver_refuses_leaves_a_discarded_page_discarded():
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    pool = vmem.PagePool(driver, 4, PAGE)
    rng = vmem.VirtualRange(pool, 4 * PAGE)
    (page,) = pool.allocate(1)
    pool.discard(page)
    committed_bytes = pool.committed_bytes
    driver.fail_at("map", 0)
    with pytest.raises(vmem.DriverCallError, match="injected fault"):
        rng.map(0, page)
    assert pool.is_discarded(page) and pool.committed_bytes == committed_bytes == 3 * PAGE
    assert not rng.is_mapped(0)
    pool.check_integrity()
    rng.map(0, page)                       # the next map re-creates it, as before
    assert pool.committed_bytes == 4 * PAGE and not pool.is_discarded(page)
    rng.close()
    pool.close()


def test_a_grow_pools_chunk_made_for_a_refused_map_stays_created_as_documented():
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    pool = vmem.PagePool(driver, 64, PAGE, grow=True)
    rng = vmem.VirtualRange(pool, PAGE)
    (page,) = pool.allocate(1)
    driver.fail_at("map", 0)
    with pytest.raises(vmem.DriverCallError):
        rng.map(0, page)
    assert (pool.committed_pages, pool.mapped_pages) == (MIN_GROWTH_PAGES, 0)
    pool.check_integrity()
    rng.close()
    pool.close()


@pytest.mark.parametrize("options, named", [
    (dict(dtype="float32"), "dtype"),
    (dict(dtype=torch.float32, shape=(3, 5)), "shape"),
    (dict(dtype=torch.float32, shape=(2, "x")), "shape"),
], ids=["dtype-a-string", "shape-of-other-bytes", "shape-not-ints"])
def test_a_bad_tensor_dtype_or_shape_is_a_typed_error_naming_it_and_counts_no_view(
        options, named):
    pool = vmem.PagePool(vmem.open_driver("host"), 1, PAGE)
    rng = vmem.VirtualRange(pool, PAGE)
    rng.map(0, pool.allocate(1)[0])
    with pytest.raises(vmem.VMemConfigError, match=named):
        rng.tensor(0, PAGE, **options)
    assert rng.live_views == 0
    assert rng.tensor(0, PAGE, dtype=torch.float32, shape=(-1, 4)).shape == (PAGE // 16, 4)
    rng.close()
    pool.close()
