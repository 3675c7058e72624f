"""Every size, count and offset that reaches a driver is an int in range, checked before any
system call, with a typed error naming the argument (vmem/checks.py)."""
import pytest

from vmemkv import vmem
from vmemkv.vmem.checks import MAX_BYTES
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

PAGE = 4096


@pytest.mark.parametrize("size", [2**64 + PAGE, 2**63, MAX_BYTES + 1])
def test_a_size_past_the_address_space_is_refused_before_any_reservation(size):
    """2**64 + 4096 reached mmap as a ctypes size_t, which kept 4096: the range believed it
    held 2**52 pages, and mapping one past the real 4 KiB replaced someone else's memory."""
    driver = FaultInjectingDriver(HostDriver())
    with vmem.PagePool(driver, 1, PAGE) as pool:
        with pytest.raises(vmem.VMemConfigError, match=f"size_bytes .* got {size}$"):
            vmem.VirtualRange(pool, size)
        assert driver.calls["reserve"] == 0
        with pytest.raises(vmem.VMemConfigError, match=f"reserve size_bytes {size} bytes is past"):
            driver.inner.reserve(size)
        with vmem.VirtualRange(pool, 2**40) as rng:     # 1 TiB: well inside
            assert rng.num_pages == 2**40 // PAGE


def test_a_pool_too_large_to_size_is_refused_naming_the_page_size_and_keeps_no_memfd(monkeypatch):
    """4 pages of 2**62 bytes started discarded, so no memory check ran: os.ftruncate raised a
    bare OverflowError, which create_pages (catching OSError only) let out past its memfd, one
    descriptor leaked a try. Now the page size is refused first, and any failure after the
    memfd is made (typed or not) closes it."""
    from .. import process_resources
    driver = HostDriver()
    with process_resources.watch() as watch:
        before = watch.snapshot().memfd_fds
        for _ in range(3):
            with pytest.raises(vmem.VMemConfigError, match=f"page_bytes {2**62} bytes is past"):
                vmem.PagePool(driver, 4, 2**62, committed_pages=0)
        too_many = MAX_BYTES // PAGE + 1
        with pytest.raises(vmem.VMemConfigError, match=f"create_pages of {too_many} pages"):
            driver.create_pages(too_many, PAGE, discarded=True)

        def interrupted(fd, size):
            raise KeyboardInterrupt
        monkeypatch.setattr("vmemkv.vmem.host.os.ftruncate", interrupted)
        with pytest.raises(KeyboardInterrupt):
            vmem.PagePool(driver, 4, PAGE)
        monkeypatch.undo()
        assert watch.snapshot().memfd_fds == before


def test_numpy_integers_are_page_ids_and_indexes_and_other_types_are_refused_by_type():
    """np.int64 ids and indexes were refused as "outside the pool" / "outside the range" (they
    are no ``int``), and a float offset was a bare TypeError from inside the check."""
    np = pytest.importorskip("numpy")
    with vmem.PagePool(HostDriver(), 4, PAGE) as pool, vmem.VirtualRange(pool, 4 * PAGE) as rng:
        ids = pool.allocate(2)
        rng.map(np.int64(1), np.int64(ids[0]))
        assert rng.mapped_pages() == {1: ids[0]} and pool.mapping_count(np.int32(ids[0])) == 1
        assert type(rng.page_at(1)) is int
        assert rng.tensor(np.int64(PAGE), np.int64(PAGE)).numel() == PAGE
        with pytest.raises(vmem.PageIndexError, match="page index must be an int, got float 2.0"):
            rng.map(2.0, ids[1])
        with pytest.raises(vmem.PageStateError, match="page id must be an int, got float 1.0"):
            rng.map(2, 1.0)
        with pytest.raises(vmem.VMemConfigError, match="offset_bytes must be an int, got float"):
            rng.tensor(1.5)
        with pytest.raises(vmem.VMemConfigError, match="num_bytes must be an int, got float"):
            rng.tensor(0, 8.0)
        assert rng.unmap(np.int64(1)) == ids[0]
        pool.release(np.array(ids))
        assert pool.free_pages == 4 and pool.allocate(1)[0] in ids
        pool.check_integrity()


def test_driver_calls_name_the_argument_they_refuse():
    driver = HostDriver()
    with pytest.raises(vmem.AlignmentError, match="reserve size_bytes 100 bytes"):
        driver.reserve(100)                        # said "page size 100 bytes"
    with pytest.raises(vmem.VMemConfigError, match="create_pages takes num_pages >= 0, got -1"):
        driver.create_pages(-1, PAGE)              # a DriverCallError from ftruncate
    with pytest.raises(vmem.VMemConfigError, match="page_bytes must be an int, got float"):
        driver.create_pages(1, float(PAGE))


def test_a_view_one_byte_past_the_range_end_is_refused_and_one_up_to_it_is_not():
    with vmem.PagePool(HostDriver(), 2, PAGE) as pool, vmem.VirtualRange(pool, 2 * PAGE) as rng:
        for index, page_id in enumerate(pool.allocate(2)):
            rng.map(index, page_id)
        assert rng.tensor(PAGE, PAGE).numel() == PAGE          # the last byte is in
        for offset, num_bytes in ((PAGE, PAGE + 1), (PAGE + 1, PAGE), (2 * PAGE, 1)):
            outside = rf"bytes \[{offset}, {offset + num_bytes}\) lie outside the range of " \
                rf"{2 * PAGE} bytes"
            with pytest.raises(vmem.PageIndexError, match=outside):
                rng.tensor(offset, num_bytes)
        assert len(rng.mapped_pages()) == 2           # nothing changed
        pool.check_integrity()
