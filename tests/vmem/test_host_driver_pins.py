"""Pins on the host driver's records and memory figures (vmem/host.py, vmem/host_records.py):
a map refused only where CUDA's cuMemMap refuses it, and /proc figures read in bytes."""
import os
import resource

import pytest

from vmemkv import vmem
from vmemkv.vmem import host as host_module
from vmemkv.vmem.host import HostDriver

PAGE = 4096


def test_a_mapping_of_another_size_may_end_exactly_where_the_next_one_begins():
    """Mixed sizes are checked by a scan; a mapping that ends where another starts does not
    overlap it ([start, end) ranges), so cuMemMap takes it and the host driver must too."""
    driver = HostDriver()
    base = driver.reserve(4 * PAGE)
    (single,) = driver.create_pages(1, PAGE)
    (double,) = driver.create_pages(1, 2 * PAGE)
    try:
        driver.map(base + 2 * PAGE, double, 2 * PAGE)
        driver.tensor(base + 2 * PAGE, 2 * PAGE).fill_(9)
        driver.map(base + PAGE, single, PAGE)               # ends at base + 2 pages: no overlap
        driver.tensor(base + PAGE, PAGE).fill_(4)
        assert driver.tensor(base + PAGE, 3 * PAGE).tolist() == [4] * PAGE + [9] * 2 * PAGE
        with pytest.raises(vmem.DriverCallError, match="mapped at"):
            driver.map(base + 3 * PAGE, single, PAGE)       # inside the double: refused
    finally:
        for address, size in ((base + PAGE, PAGE), (base + 2 * PAGE, 2 * PAGE)):
            driver.unmap_if_mapped(address, size)
        driver.free_reservation(base, 4 * PAGE)
        driver.release_pages([single, double])


def test_a_map_below_every_reservation_of_the_driver_is_refused():
    """Two drivers, one reservation each: the one whose reservation lies higher refuses a map
    at the other's address (below all of its own), which lies outside every reservation it
    made. Both ranges are this test's, so nothing else is touched either way."""
    first, second = HostDriver(), HostDriver()
    bases = {first: first.reserve(2 * PAGE), second: second.reserve(2 * PAGE)}
    higher, lower = sorted(bases, key=bases.get, reverse=True)
    (page,) = higher.create_pages(1, PAGE)
    try:
        with pytest.raises(vmem.DriverCallError, match="outside every reservation"):
            higher.map(bases[lower], page, PAGE)
        assert not higher.unmap_if_mapped(bases[lower], PAGE)
    finally:
        higher.release_pages([page])
        for driver, base in bases.items():
            driver.free_reservation(base, 2 * PAGE)


def test_meminfo_fields_are_read_in_bytes():
    """/proc/meminfo gives kB (1024 bytes); MemTotal equals the kernel's physical pages."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert host_module.meminfo_bytes("MemTotal") == kib * 1024
    assert host_module.meminfo_bytes("NoSuchField") is None


def test_the_address_space_left_under_ulimit_v_is_the_limit_less_what_is_mapped():
    """``ulimit -v`` bounds the whole address space: what is left is the limit less this
    process's VmSize (hundreds of MiB with torch loaded), never the limit itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = used + 2**40
    if hard != resource.RLIM_INFINITY and limit > hard:
        pytest.skip("the hard RLIMIT_AS is below what this test sets")
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        left = host_module.address_space_left_bytes()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert limit - used - 2**26 <= left <= limit - used + 2**26   # within 64 MiB of it


def test_a_recreate_failing_part_way_gives_back_the_pages_it_had_backed(monkeypatch):
    """recreate_pages is all or nothing: when the second page's fallocate fails (ENOSPC, a
    full tmpfs), the first page's blocks are punched out again, so the memfd holds nothing."""
    import errno
    driver = HostDriver()
    pages = driver.create_pages(2, PAGE, discarded=True)
    real, calls = os.posix_fallocate, []

    def fallocate_failing_second(fd, offset, length):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate_failing_second)
    try:
        with pytest.raises(vmem.DriverCallError, match="recreate_pages: posix_fallocate"):
            driver.recreate_pages(pages, PAGE)
        assert calls == [0, PAGE]
        assert os.fstat(pages[0].fd).st_blocks == 0       # the first page's blocks went back
    finally:
        monkeypatch.undo()
        driver.release_pages([], discarded=pages)


def test_releasing_pages_that_were_all_discarded_closes_their_memfd():
    """A pool whose every page is discarded hands them to release_pages as ``discarded`` only:
    their memfd must still be closed (else one file descriptor leaks per such pool)."""
    driver = HostDriver()
    pages = driver.create_pages(2, PAGE)
    driver.discard_pages(pages, PAGE)
    fd = pages[0].fd
    inode = os.fstat(fd).st_ino                            # open now
    driver.release_pages([], discarded=pages)
    try:
        still = os.fstat(fd).st_ino == inode               # (the number may name a new file)
    except OSError:
        still = False
    assert not still


def test_pool_records_are_refused_one_page_past_the_available_memory(monkeypatch):
    """check_pool_records: RECORD_BYTES a page must fit what the host has available; the
    exact fit passes, one page more is refused naming both sizes."""
    per = host_module.RECORD_BYTES
    monkeypatch.setattr(host_module, "meminfo_bytes", lambda field: 1000 * per)
    monkeypatch.setattr(host_module, "address_space_left_bytes", lambda: None)
    host_module.check_pool_records(1000)
    with pytest.raises(vmem.InsufficientMemoryError,
                       match=f"1001 pages keeps about {1001 * per} bytes .* only {1000 * per} bytes"):
        host_module.check_pool_records(1001)


def test_the_host_driver_reports_the_smaller_of_free_memory_and_address_space_left(monkeypatch):
    """available_bytes: MemAvailable, or less when ``ulimit -v`` leaves less to map it in."""
    monkeypatch.setattr(host_module, "meminfo_bytes", lambda field: 8 * 2**30)
    monkeypatch.setattr(host_module, "address_space_left_bytes", lambda: 2**30)
    assert HostDriver().available_bytes() == 2**30
    monkeypatch.setattr(host_module, "address_space_left_bytes", lambda: None)
    assert HostDriver().available_bytes() == 8 * 2**30


def test_a_freed_reservation_is_forgotten_and_cannot_be_freed_or_mapped_again():
    """After free_reservation the records hold nothing there: a second free, or a map into
    it, is refused (cuMemAddressFree and cuMemMap refuse both) before any system call."""
    driver = HostDriver()
    base = driver.reserve(2 * PAGE)
    (page,) = driver.create_pages(1, PAGE)
    driver.free_reservation(base, 2 * PAGE)
    try:
        with pytest.raises(vmem.DriverCallError, match="no reservation starts there"):
            driver.free_reservation(base, 2 * PAGE)
        with pytest.raises(vmem.DriverCallError, match="outside every reservation"):
            driver.map(base, page, PAGE)
    finally:
        driver.release_pages([page])
