"""Elastic pages (issue 32): ``PagePool.discard`` gives a page's memory back to the device page
by page, mapping it again (or ``recommit``) re-creates exactly that page, and ``extend`` adds
ids. Host memory is measured where it lives: the memfds' allocated blocks (``st_blocks``). The
state machine over the same calls is in test_pool_discard_machine.py."""
from __future__ import annotations

import pytest
import torch

from vmemkv import vmem
from vmemkv.vmem.host import HostDriver
from vmemkv.vmem.pool import RECORD_BYTES

from .elastic_pages import ElasticDriver, counts
from .forking import child_result, in_child


@pytest.fixture
def host():
    driver = ElasticDriver(HostDriver())
    yield driver, driver.granularity_bytes
    driver.close()


# -- host: memory really goes back, and comes back --
def test_discard_gives_back_exactly_the_pages_bytes_and_recreation_brings_them_back(host):
    driver, page = host
    with vmem.PagePool(driver, 8, page) as pool, vmem.VirtualRange(pool, page) as rng:
        ids = pool.allocate(8)
        assert driver.memfd_bytes() == 8 * page
        pool.discard([ids[1], ids[3], ids[4]])
        assert driver.memfd_bytes() == 5 * page
        assert counts(pool) == (8, 5, 3, 0, 0, 5 * page)     # ids stay allocated
        assert [pool.is_discarded(i) for i in ids] == [False, True, False, True, True, False,
                                                        False, False]
        pool.recommit([ids[3]])
        assert driver.memfd_bytes() == 6 * page and pool.discarded_pages == 2
        rng.map(0, ids[1])                                    # re-created on mapping
        assert driver.memfd_bytes() == 7 * page and pool.committed_pages == 7
        assert driver.calls["recreate_pages"] == 2 and driver.calls["create_pages"] == 1
        pool.check_integrity()
        rng.unmap(0)
        pool.release(ids)


def test_a_recreated_host_page_reads_zeros_then_holds_new_bytes(host):
    driver, page = host
    with vmem.PagePool(driver, 2, page) as pool, vmem.VirtualRange(pool, 2 * page) as rng:
        first, other = pool.allocate(2)
        rng.map(0, first)
        rng.map(1, other)
        rng.tensor(0, 2 * page).fill_(0xAB)
        rng.unmap(0)
        pool.discard(first)
        rng.map(0, first)
        assert int(rng.tensor(0, page).count_nonzero()) == 0        # the old bytes are gone
        assert bool((rng.tensor(page, page) == 0xAB).all())          # its neighbour kept its own
        rng.tensor(0, page, torch.int32).copy_(torch.arange(page // 4, dtype=torch.int32))
        rng.unmap(0)
        rng.map(0, first)                                            # same page, same bytes
        assert torch.equal(rng.tensor(0, page, torch.int32),
                           torch.arange(page // 4, dtype=torch.int32))
        rng.close()
        pool.release([first, other])


def test_close_never_releases_a_discarded_handle_as_a_live_page(host):
    driver, page = host
    pool = vmem.PagePool(driver, 4, page)
    pool.discard([0, 2])
    pool.close()
    (live, gone), = driver.released
    assert gone == [driver.created[0], driver.created[2]]
    assert live == [driver.created[1], driver.created[3]]


def test_a_driver_failure_part_way_leaves_exactly_the_pages_before_it_discarded(host):
    driver, page = host
    with vmem.PagePool(driver, 4, page) as pool:
        driver.fail_at("discard_pages", 1)
        with pytest.raises(vmem.DriverCallError, match="injected"):
            pool.discard([3, 1, 2])
        assert [pool.is_discarded(i) for i in range(4)] == [False, False, False, True]
        assert driver.memfd_bytes() == 3 * page and pool.committed_pages == 3
        pool.check_integrity()


# -- refusals: typed, and nothing changes --
@pytest.mark.parametrize("case", ["mapped", "bad-id", "not-an-int", "twice", "duplicate",
                                  "never-created", "closed"])
def test_a_refused_discard_is_typed_and_changes_nothing(driver, page_bytes, case):
    pool = vmem.PagePool(driver, 4, page_bytes, grow=case == "never-created")
    rng = vmem.VirtualRange(pool, page_bytes)
    ids = pool.allocate(4)
    rng.map(0, ids[0])                 # a grow pool creates all 4 (a chunk), binds only this one
    if case != "never-created":
        pool.discard(ids[1])
    error, name, pages = vmem.PageStateError, "page 0 is still mapped", [ids[0]]
    if case == "bad-id":
        name, pages = "page id 4 outside", [ids[2], 4]
    elif case == "not-an-int":
        name, pages = "page id must be an int, got str 'x'", ["x"]
    elif case == "twice":
        name, pages = "page 1 is already discarded", [ids[2], ids[1]]
    elif case == "duplicate":
        name, pages = "name a page twice", [ids[2], ids[2]]
    elif case == "never-created":
        name, pages = "page 1 was never created", [ids[1]]
    elif case == "closed":
        rng.close()
        pool.release(ids)
        pool.close()
        error, name, pages = vmem.ClosedError, "after close", [ids[2]]
    before = counts(pool)
    with pytest.raises(error, match=name):
        pool.discard(pages)
    assert counts(pool) == before
    if case != "closed":
        assert not pool.is_discarded(ids[2]) and pool.mapping_count(ids[0]) == 1
        pool.check_integrity()
        rng.close()
        pool.release(ids)
        pool.close()


def test_recommit_refuses_a_page_that_is_not_discarded(host):
    driver, page = host
    with vmem.PagePool(driver, 3, page) as pool:
        pool.discard([0, 1])
        with pytest.raises(vmem.PageStateError, match="page 2 is not discarded"):
            pool.recommit([0, 2])
        assert pool.discarded_pages == 2 and driver.calls["recreate_pages"] == 0


def test_a_forked_child_cannot_discard_or_recommit(host):
    driver, page = host
    with vmem.PagePool(driver, 2, page) as pool:
        pool.discard(0)

        def child():
            refused = 0
            for attempt in (lambda: pool.discard(1), lambda: pool.recommit(0),
                            lambda: pool.extend(1)):
                try:
                    attempt()
                except vmem.ForkedError:
                    refused += 1
            return refused
        assert child_result(*in_child(child)) == "3"
        assert driver.memfd_bytes() == page and pool.discarded_pages == 1
        pool.check_integrity()


# -- re-creation: the same page again, or a typed refusal --
def test_a_discarded_page_mapped_again_works(driver, page_bytes):
    with vmem.PagePool(driver, 2, page_bytes) as pool, \
            vmem.VirtualRange(pool, 2 * page_bytes) as rng:
        page, other = pool.allocate(2)
        pool.discard(page)
        creates = pool.committed_pages
        rng.map(1, page)
        assert pool.committed_pages == creates + 1 and pool.discarded_pages == 0
        rng.map(0, other)
        view = rng.tensor(0, 2 * page_bytes, torch.int32)
        view.copy_(torch.arange(view.numel(), dtype=torch.int32, device=view.device))
        rng.unmap(1)
        rng.map(1, page)                      # the re-created page kept what was written
        again = rng.tensor(page_bytes, page_bytes, torch.int32).cpu()
        assert torch.equal(again, torch.arange(view.numel() // 2, view.numel(), dtype=torch.int32))
        pool.check_integrity()
        rng.close()
        pool.release([page, other])


@pytest.mark.parametrize("how", ["map", "recommit"])
def test_an_injected_recreate_failure_leaves_the_page_discarded(host, how):
    driver, page = host
    with vmem.PagePool(driver, 2, page) as pool, vmem.VirtualRange(pool, page) as rng:
        ids = pool.allocate(2)
        pool.discard(ids)
        before, blocks = counts(pool), driver.memfd_bytes()
        driver.fail_at("recreate_pages", 0)
        with pytest.raises(vmem.DriverCallError, match="recreate_pages: injected"):
            rng.map(0, ids[0]) if how == "map" else pool.recommit(ids)
        assert counts(pool) == before and driver.memfd_bytes() == blocks == 0
        assert pool.is_discarded(ids[0]) and not rng.is_mapped(0)
        pool.check_integrity()
        rng.map(0, ids[0])                    # the next try re-creates it
        assert pool.committed_pages == 1 and driver.memfd_bytes() == page
        rng.unmap(0)
        pool.release(ids)


@pytest.mark.parametrize("how", ["map", "recommit"])
def test_a_memory_shortage_refuses_the_recreation_before_the_driver(host, how):
    driver, page = host
    with vmem.PagePool(driver, 2, page) as pool, vmem.VirtualRange(pool, page) as rng:
        ids = pool.allocate(2)
        pool.discard(ids)
        driver.available = (1 if how == "map" else 2) * page - 1
        with pytest.raises(vmem.InsufficientMemoryError,
                           match=f"re-creating {1 if how == 'map' else 2} pages of {page} bytes"):
            rng.map(0, ids[0]) if how == "map" else pool.recommit(ids)
        assert driver.calls["recreate_pages"] == 0 and pool.discarded_pages == 2
        assert driver.memfd_bytes() == 0 and not rng.is_mapped(0)
        pool.check_integrity()
        if how == "map":                      # one page fits: mapping re-creates just that one
            driver.available = page
            rng.map(0, ids[0])
            assert pool.committed_pages == 1
            rng.unmap(0)
        pool.release(ids)


# -- extend --
def test_extend_an_eager_pool_creates_the_new_pages_now(host):
    driver, page = host
    with vmem.PagePool(driver, 4, page) as pool, vmem.VirtualRange(pool, page) as rng:
        old = pool.allocate(2)
        assert pool.extend(3) == [4, 5, 6]
        assert counts(pool) == (7, 7, 0, 5, 0, 7 * page) and driver.memfd_bytes() == 7 * page
        assert pool.allocate(2) == [2, 3]     # the warm free pages first, then the new ones
        assert pool.allocate(3) == [4, 5, 6]
        rng.map(0, 6)
        rng.tensor(0, page).fill_(9)
        assert int(rng.tensor(0, page).sum()) == 9 * page
        driver.available = 2 * page
        with pytest.raises(vmem.InsufficientMemoryError, match="creating 3 pages"):
            pool.extend(3)
        assert pool.extend(0) == [] and pool.total_pages == 7
        with pytest.raises(vmem.VMemConfigError, match="extend takes a page count >= 0"):
            pool.extend(-1)
        pool.check_integrity()
        rng.unmap(0)
        pool.release(old + [2, 3, 4, 5, 6])


def test_extend_an_on_demand_pool_creates_pages_on_first_mapping(host):
    driver, page = host
    with vmem.PagePool(driver, 4, page, grow=True) as pool, vmem.VirtualRange(pool, page) as rng:
        assert pool.extend(30) == list(range(4, 34))
        assert pool.total_pages == 34 and pool.committed_pages == 0 and driver.memfd_bytes() == 0
        ids = pool.allocate(34)
        rng.map(0, 33)                        # a chunk of 16, as any first growth
        assert pool.committed_pages == 16 and driver.memfd_bytes() == 16 * page
        rng.unmap(0)
        pool.discard(33)
        rng.map(0, 33)                        # exactly that page again, not a chunk
        assert driver.calls["create_pages"] == 1 and driver.calls["recreate_pages"] == 1
        assert pool.committed_pages == 16 and driver.memfd_bytes() == 16 * page
        pool.check_integrity()
        rng.unmap(0)
        pool.release(ids)


def test_on_demand_growth_counts_pages_created_not_committed(host):
    driver, page = host
    with vmem.PagePool(driver, 2, page, grow=True) as pool, vmem.VirtualRange(pool, page) as rng:
        ids = pool.allocate(2)
        for page_id in ids:                   # the first growth creates both
            rng.map(0, page_id)
            rng.unmap(0)
        pool.discard(ids[0])
        ids += pool.extend(1)
        pool.allocate(1)
        rng.map(0, 2)                         # the stock is empty: one more page, not two
        assert driver.calls["create_pages"] == 2 and pool.committed_pages == 2
        assert driver.memfd_bytes() == 2 * page and pool.discarded_pages == 1
        pool.check_integrity()
        rng.unmap(0)
        pool.release(ids)


# -- a pool that starts below its size --
@pytest.mark.parametrize("grow", [False, True], ids=["eager", "on-demand"])
def test_committed_pages_starts_the_rest_discarded_and_maps_them_one_by_one(host, grow):
    driver, page = host
    driver.available = 3 * page + 8 * RECORD_BYTES   # the 8 pages would not fit; the 3 and
    # the records of the 8 ids (checked with the 3 pages) do
    with vmem.PagePool(driver, 8, page, grow=grow, committed_pages=3) as pool, \
            vmem.VirtualRange(pool, page) as rng:
        ids = pool.allocate(8)
        assert [pool.is_discarded(i) for i in ids] == [False] * 3 + [True] * 5
        assert pool.committed_pages == driver.memfd_bytes() // page == (0 if grow else 3)
        driver.available = None
        rng.map(0, 6)                         # exactly that page, never a chunk
        assert pool.committed_pages == (1 if grow else 4)
        assert driver.memfd_bytes() == pool.committed_bytes
        rng.tensor(0, page).fill_(5)
        assert int(rng.tensor(0, page).sum()) == 5 * page
        rng.unmap(0)
        rng.map(0, 0)                         # below committed_pages: as any (grow: 3 at once)
        assert pool.committed_pages == 4 and pool.discarded_pages == 4
        pool.check_integrity()
        rng.unmap(0)
        pool.release(ids)
    (live, gone), *rest = driver.released      # the discarded tail is never released as live
    assert len(gone) + sum(len(g) for _, g in rest) == 4


@pytest.mark.parametrize("bad", [-1, 9, 2.0, True])
def test_committed_pages_outside_the_pool_is_refused_before_any_page(host, bad):
    driver, page = host
    with pytest.raises(vmem.VMemConfigError, match=f"committed_pages must be None or in 0..8, "
                                                   f"got {bad!r}"):
        vmem.PagePool(driver, 8, page, committed_pages=bad)
    assert driver.calls["create_pages"] == 0


def test_a_failed_build_leaves_no_page_behind(host):
    driver, page = host
    driver.fail_at("create_pages", 1)         # the discarded tail's batch
    with pytest.raises(vmem.DriverCallError):
        vmem.PagePool(driver, 4, page, committed_pages=2)
    (live, gone), = driver.released
    assert live == driver.created[:2] and gone == []


# -- CUDA --
def test_cuda_pool_releases_every_handle_once_across_discard_and_recreate():
    """Through the real cuda-python bindings and a stand-in for libcuda (test_cuda_contract)."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests make these calls for real")
    from .test_cuda_contract import GRANULARITY, LibcudaStandIn, bound_driver

    class Recording(LibcudaStandIn):
        def _answer(self, name, args):
            if name == "cuMemRelease":
                released.append(int(args[0]))
            if name == "cuMemGetInfo":
                return (80 * GRANULARITY, 80 * GRANULARITY)
            return super()._answer(name, args)
    released: list[int] = []
    cuda = bound_driver(Recording())
    pool = vmem.PagePool(cuda, 3, GRANULARITY)           # handles 2, 3, 4
    pool.discard([0, 2])
    assert released == [2, 4]
    pool.recommit(0)                                     # a new handle, 5
    pool.close()
    assert sorted(released) == [2, 3, 4, 5]              # each exactly once; 4 never again
    released.clear()
    pool = vmem.PagePool(cuda, 3, GRANULARITY, committed_pages=1)   # 6; two placeholders
    pool.recommit(2)                                     # 7
    pool.close()
    assert sorted(released) == [6, 7]                    # a placeholder is never released


@pytest.mark.gpu
def test_cuda_discard_frees_device_memory_and_recreation_takes_it_again():
    cuda = vmem.open_driver("cuda")
    page, n = cuda.granularity_bytes, 8
    try:
        with vmem.PagePool(cuda, n, page) as pool, vmem.VirtualRange(pool, page) as rng:
            ids = pool.allocate(n)
            before = cuda.available_bytes()
            pool.discard(ids)
            freed = cuda.available_bytes() - before
            assert freed >= (n - 1) * page and pool.committed_pages == 0
            pool.recommit(ids[1:])
            rng.map(0, ids[0])
            rng.tensor(0, page).fill_(3)
            assert int(rng.tensor(0, page).sum().item()) == 3 * page
            assert before - cuda.available_bytes() <= page
            rng.unmap(0)
            pool.release(ids)
    finally:
        cuda.close()
