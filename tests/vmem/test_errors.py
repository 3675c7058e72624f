"""Every user error is typed, names the value and the limit, and leaves state unchanged."""
import pytest
import torch

from vmemkv import vmem
from vmemkv.vmem.faults import FaultInjectingDriver
def snapshot(pool, *ranges):
    return (pool.free_pages, pool.mapped_pages,
            [pool.mapping_count(p) for p in range(pool.total_pages)],
            [r.mapped_pages() for r in ranges])


@pytest.fixture
def setup(driver, page_bytes):
    pool = vmem.PagePool(driver, 2, page_bytes)
    rng = vmem.VirtualRange(pool, 4 * page_bytes)
    page = pool.allocate(1)[0]
    rng.map(1, page)
    yield pool, rng, page
    rng.close()
    pool.close()


def test_page_size_not_a_multiple_of_granularity(driver, page_bytes):
    with pytest.raises(vmem.AlignmentError, match=str(page_bytes)):
        vmem.PagePool(driver, 1, page_bytes + 512)


def test_page_index_outside_range(setup):
    pool, rng, page = setup
    before = snapshot(pool, rng)
    with pytest.raises(vmem.PageIndexError, match=r"4.*0\.\.3"):
        rng.map(4, page)
    with pytest.raises(vmem.PageIndexError):
        rng.unmap(-1)
    assert snapshot(pool, rng) == before


def test_mapping_an_already_mapped_index(setup):
    pool, rng, page = setup
    before = snapshot(pool, rng)
    with pytest.raises(vmem.AlreadyMappedError, match="page index 1"):
        rng.map(1, page)
    assert snapshot(pool, rng) == before


def test_unmapping_an_index_with_nothing_mapped(setup):
    pool, rng, _ = setup
    before = snapshot(pool, rng)
    with pytest.raises(vmem.NotMappedError, match="page index 2"):
        rng.unmap(2)
    assert snapshot(pool, rng) == before


def test_pool_exhausted_names_free_and_asked(setup):
    pool, rng, _ = setup
    before = snapshot(pool, rng)
    with pytest.raises(vmem.PoolExhaustedError, match=r"asked for 5 pages, 1 of 2 free"):
        pool.allocate(5)
    assert snapshot(pool, rng) == before


def test_releasing_a_mapped_page(setup):
    pool, rng, page = setup
    before = snapshot(pool, rng)
    with pytest.raises(vmem.PageStateError, match=f"page {page} is still mapped"):
        pool.release(page)
    assert snapshot(pool, rng) == before


def test_releasing_a_free_page_twice(setup):
    pool, rng, _ = setup
    (other,) = pool.allocate(1)
    pool.release(other)
    before = snapshot(pool, rng)
    with pytest.raises(vmem.PageStateError, match="already free"):
        pool.release(other)
    assert snapshot(pool, rng) == before


def test_mapping_a_page_never_allocated(setup):
    pool, rng, _ = setup
    free_page = next(p for p in range(pool.total_pages) if pool.is_free(p))
    before = snapshot(pool, rng)
    with pytest.raises(vmem.PageStateError, match="allocate it"):
        rng.map(0, free_page)
    assert snapshot(pool, rng) == before


def test_view_outside_range_or_misaligned(setup):
    pool, rng, _ = setup
    with pytest.raises(vmem.PageIndexError, match="outside"):
        rng.tensor(0, rng.size_bytes + 4, torch.float32)
    with pytest.raises(vmem.AlignmentError, match="element size 4"):
        rng.tensor(2, 8, torch.float32)


def test_pool_close_refused_while_mapped(setup):
    pool, rng, _ = setup
    with pytest.raises(vmem.PageStateError, match="still mapped"):
        pool.close()
    assert not pool.closed


def test_an_unmap_the_driver_refuses_leaves_the_page_mapped(driver, page_bytes):
    """The driver raised before unmapping: the range still records the page there, so the pool
    refuses to release it (its memory is still mapped), and a later unmap succeeds."""
    faulty = FaultInjectingDriver(driver)
    pool = vmem.PagePool(faulty, 2, page_bytes)
    rng = vmem.VirtualRange(pool, 4 * page_bytes)
    page = pool.allocate(1)[0]
    rng.map(1, page)
    before = snapshot(pool, rng)
    faulty.fail_at("unmap", 0)
    with pytest.raises(vmem.DriverCallError, match="injected fault"):
        rng.unmap(1)
    assert rng.is_mapped(1) and snapshot(pool, rng) == before
    with pytest.raises(vmem.PageStateError):
        pool.release(page)
    assert rng.unmap(1) == page
    pool.release(page)
    assert pool.free_pages == 2
    rng.close()
    pool.close()


def test_use_after_close(driver, page_bytes):
    pool = vmem.PagePool(driver, 1, page_bytes)
    rng = vmem.VirtualRange(pool, page_bytes)
    rng.close()
    pool.close()
    for call in (lambda: rng.map(0, 0), lambda: rng.unmap(0), lambda: rng.tensor(0, 4),
                 lambda: rng.mapped_pages(), lambda: pool.allocate(1), lambda: pool.release(0)):
        with pytest.raises(vmem.ClosedError, match="after close"):
            call()


def test_unknown_driver_name():
    with pytest.raises(vmem.VMemConfigError, match="'tpu'"):
        vmem.open_driver("tpu")


def test_cuda_requested_without_gpu_says_why():
    from vmemkv.vmem.cuda import cuda_unavailable_reason
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("a GPU and cuda-python are present here")
    with pytest.raises(vmem.DriverUnavailableError, match="CUDA driver unavailable") as info:
        vmem.open_driver("cuda")
    assert reason in str(info.value)
    assert vmem.available_drivers()["cuda"] == reason
