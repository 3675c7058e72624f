"""vmem semantics shared by both drivers: sharing, persistence, views, errors leave state alone."""
import pytest
import torch

from vmemkv import vmem
def test_shared_page_shows_same_bytes_in_one_range(driver, page_bytes):
    with vmem.PagePool(driver, 2, page_bytes) as pool, vmem.VirtualRange(pool, 4 * page_bytes) as rng:
        (page,) = pool.allocate(1)
        rng.map(0, page)
        rng.map(2, page)
        first = rng.tensor(0, page_bytes, torch.int32)
        third = rng.tensor(2 * page_bytes, page_bytes, torch.int32)
        first.copy_(torch.arange(first.numel(), dtype=torch.int32, device=first.device))
        assert torch.equal(third.cpu(), torch.arange(third.numel(), dtype=torch.int32))
        assert pool.mapping_count(page) == 2
        rng.unmap(0)
        rng.unmap(2)


def test_shared_page_shows_same_bytes_across_ranges(driver, page_bytes):
    with vmem.PagePool(driver, 1, page_bytes) as pool:
        with vmem.VirtualRange(pool, page_bytes) as a, vmem.VirtualRange(pool, 3 * page_bytes) as b:
            (page,) = pool.allocate(1)
            a.map(0, page)
            b.map(1, page)
            a.tensor(0, 8, torch.float32).fill_(2.5)
            assert b.tensor(page_bytes, 8, torch.float32).cpu().tolist() == [2.5, 2.5]
            assert pool.mapping_count(page) == 2 and pool.mapped_pages == 1


def test_data_survives_unmap_and_remap_of_other_pages(driver, page_bytes):
    with vmem.PagePool(driver, 3, page_bytes) as pool, vmem.VirtualRange(pool, 3 * page_bytes) as rng:
        keep, other, spare = pool.allocate(3)
        rng.map(0, keep)
        rng.tensor(0, page_bytes, torch.uint8).fill_(0xAB)
        for _ in range(3):
            rng.map(1, other)
            rng.tensor(page_bytes, page_bytes, torch.uint8).fill_(0x11)
            rng.unmap(1)
            rng.map(1, spare)
            rng.unmap(1)
        assert bool((rng.tensor(0, page_bytes).cpu() == 0xAB).all())
        # the unmapped page kept its bytes too: mapping it again shows them
        rng.map(2, other)
        assert bool((rng.tensor(2 * page_bytes, page_bytes).cpu() == 0x11).all())


def test_tensor_view_has_dtype_shape_and_is_zero_copy(driver, page_bytes):
    with vmem.PagePool(driver, 1, page_bytes) as pool, vmem.VirtualRange(pool, page_bytes) as rng:
        rng.map(0, pool.allocate(1)[0])
        view = rng.tensor(0, 64 * 4, torch.float32, shape=(8, 8))
        assert view.shape == (8, 8) and view.dtype == torch.float32
        assert view.data_ptr() == rng.address
        again = rng.tensor(0, 64 * 4, torch.float32, shape=(8, 8))
        view[3, 4] = 42.0
        assert again[3, 4].item() == 42.0
        rng.unmap(0)


def test_range_size_rounds_up_to_whole_pages(driver, page_bytes):
    with vmem.PagePool(driver, 1, page_bytes) as pool, vmem.VirtualRange(pool, page_bytes + 1) as rng:
        assert rng.num_pages == 2 and rng.size_bytes == 2 * page_bytes


def test_close_unmaps_everything_and_keeps_pages_allocated(driver, page_bytes):
    pool = vmem.PagePool(driver, 2, page_bytes)
    rng = vmem.VirtualRange(pool, 2 * page_bytes)
    pages = pool.allocate(2)
    rng.map(0, pages[0])
    rng.map(1, pages[1])
    rng.close()
    assert pool.mapped_pages == 0 and pool.allocated_pages == 2
    for page in pages:
        pool.release(page)
    pool.close()
    with pytest.raises(vmem.ClosedError):
        rng.map(0, 0)
    with pytest.raises(vmem.ClosedError):
        pool.allocate(1)


def test_copy_page_copies_bytes(driver, page_bytes):
    with vmem.PagePool(driver, 2, page_bytes) as pool, vmem.VirtualRange(pool, 2 * page_bytes) as rng:
        a, b = pool.allocate(2)
        rng.map(0, a)
        rng.map(1, b)
        rng.tensor(0, page_bytes).fill_(7)
        rng.copy_page(1, 0)
        assert bool((rng.tensor(page_bytes, page_bytes).cpu() == 7).all())


def test_tensor_made_over_an_unmapped_reservation_sees_pages_mapped_later(driver, page_bytes):
    """Caches make their tensors before mapping anything: that must work on every driver, and
    the tensor must see whatever is mapped under it afterwards (it holds only an address)."""
    with vmem.PagePool(driver, 2, page_bytes) as pool, vmem.VirtualRange(pool, 4 * page_bytes) as rng:
        whole = rng.tensor(0, 4 * page_bytes, torch.int32)      # nothing mapped yet
        assert whole.device.type == driver.device.split(":")[0] and whole.data_ptr() == rng.address
        first, second = pool.allocate(2)
        rng.map(3, first)
        rng.map(1, second)
        per_page = page_bytes // 4
        whole[3 * per_page:].fill_(7)
        whole[per_page:2 * per_page].copy_(torch.arange(per_page, dtype=torch.int32, device=whole.device))
        assert bool((rng.tensor(3 * page_bytes, page_bytes, torch.int32).cpu() == 7).all())
        assert torch.equal(rng.tensor(page_bytes, page_bytes, torch.int32).cpu(),
                           torch.arange(per_page, dtype=torch.int32))
        rng.unmap(1)
        rng.unmap(3)
