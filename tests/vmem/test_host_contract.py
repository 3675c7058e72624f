"""The host driver refuses what CUDA VMM refuses (vmem/host_records.py), so a CPU test cannot
pass where the GPU would fail: mmap took every one of these, and MAP_FIXED replaced whatever
was at the address."""
import mmap

import pytest
import torch

from vmemkv import vmem
from vmemkv.vmem.host import HostDriver

PAGE = 4096


@pytest.fixture
def host():
    driver = HostDriver()
    base = driver.reserve(4 * PAGE)
    pages = list(driver.create_pages(2, PAGE)) + list(driver.create_pages(1, 2 * PAGE))
    yield driver, base, pages
    for address in range(base, base + 4 * PAGE, PAGE):
        driver.unmap_if_mapped(address, PAGE)
    driver.free_reservation(base, 4 * PAGE)
    driver.release_pages(pages)


def test_a_mapping_is_never_replaced_or_overlapped(host):
    driver, base, (first, second, double) = host
    driver.map(base, first, PAGE)
    driver.tensor(base, PAGE).fill_(7)
    with pytest.raises(vmem.DriverCallError, match=f"4096 bytes are mapped at {base:#x}"):
        driver.map(base, second, PAGE)                    # MAP_FIXED replaced the page
    driver.map(base + 2 * PAGE, double, 2 * PAGE)         # another size: overlaps by a scan
    with pytest.raises(vmem.DriverCallError, match="mapped at"):
        driver.map(base + 3 * PAGE, second, PAGE)
    assert driver.tensor(base, PAGE).eq(7).all()          # still the first page
    driver.unmap(base + 2 * PAGE, 2 * PAGE)
    driver.map(base + 3 * PAGE, second, PAGE)


def test_a_map_outside_the_reservations_or_past_its_page_is_refused(host):
    driver, base, (first, _, double) = host
    victim = mmap.mmap(-1, PAGE)
    victim[:3] = b"abc"
    address = torch.frombuffer(victim, dtype=torch.uint8).data_ptr()
    with pytest.raises(vmem.DriverCallError, match="outside every reservation"):
        driver.map(address, first, PAGE)
    with pytest.raises(vmem.DriverCallError, match="outside every reservation"):
        driver.map(base + 3 * PAGE, double, 2 * PAGE)     # past the reservation's end
    with pytest.raises(vmem.DriverCallError, match=f"the page holds {PAGE} bytes"):
        driver.map(base, first, 2 * PAGE)                 # past the memfd page
    assert victim[:3] == b"abc"
    victim.close()


def test_an_unmap_or_free_of_what_is_not_there_is_refused(host):
    driver, base, (first, _, _) = host
    with pytest.raises(vmem.DriverCallError, match="no mapping of 4096 bytes starts there"):
        driver.unmap(base + PAGE, PAGE)                   # never mapped
    driver.map(base, first, PAGE)
    with pytest.raises(vmem.DriverCallError, match="no mapping of 8192 bytes"):
        driver.unmap(base, 2 * PAGE)                      # a mapping is unmapped whole
    with pytest.raises(vmem.DriverCallError, match=f"the reservation there is {4 * PAGE} bytes"):
        driver.free_reservation(base, PAGE)               # munmap freed part of it
    with pytest.raises(vmem.DriverCallError, match="no reservation starts there"):
        driver.free_reservation(base + PAGE, PAGE)
    assert driver.unmap_if_mapped(base, PAGE) and not driver.unmap_if_mapped(base, PAGE)
    driver.map(base + 3 * PAGE, first, PAGE)              # the reservation is whole


def test_a_closed_host_driver_makes_nothing_new_but_gives_back_what_it_made():
    driver = HostDriver()
    base = driver.reserve(PAGE)
    (page,) = driver.create_pages(1, PAGE)
    driver.map(base, page, PAGE)
    driver.close()
    for make in (lambda: driver.reserve(PAGE), lambda: driver.create_pages(1, PAGE),
                 lambda: driver.map(base, page, PAGE),
                 lambda: driver.recreate_pages([page], PAGE)):
        with pytest.raises(vmem.ClosedError, match="closed"):
            make()
    driver.unmap(base, PAGE)
    driver.free_reservation(base, PAGE)
    driver.release_pages([page])
