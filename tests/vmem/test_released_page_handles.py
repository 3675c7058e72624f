"""A HostDriver refuses a page handle whose pages were released, as cuMemMap and cuMemRelease
refuse a released handle (vmem/host_records.py ``PageFiles``).

A released memfd's fd number is the next ``create_pages``' memfd: a map of the old handle showed
the new pool's bytes (one tenant reading another's KV), a discard punched holes in the new
pool's pages, and a second release closed the new pool's file.
"""
import os

import pytest

from vmemkv import vmem


@pytest.fixture
def reused():
    """A driver, an address, a released handle, and the live pages made after it (same fd)."""
    driver = vmem.open_driver("host")
    page = driver.granularity_bytes
    address = driver.reserve(2 * page)
    (old,) = driver.create_pages(1, page)
    driver.release_pages([old])
    (new,) = driver.create_pages(1, page)
    # new.fd == old.fd here (the lowest free number): the case that matters
    driver.map(address + page, new, page)
    driver.tensor(address + page, page).fill_(42)        # the new pages' owner writes
    yield driver, page, address, old, new
    driver.unmap(address + page, page)
    driver.release_pages([new])
    driver.free_reservation(address, 2 * page)


def _new_pages_intact(driver, page, address, new):
    assert int(driver.tensor(address + page, page).sum()) == 42 * page
    os.fstat(new.fd)                                     # its file still open
    assert os.fstat(new.fd).st_blocks * 512 >= page      # its memory still there


def test_a_released_handle_cannot_map_the_pages_now_behind_its_fd(reused):
    driver, page, address, old, new = reused
    with pytest.raises(vmem.DriverCallError, match="released"):
        driver.map(address, old, page)
    assert not driver.unmap_if_mapped(address, page)     # nothing was mapped
    _new_pages_intact(driver, page, address, new)


@pytest.mark.parametrize("call", ["discard_pages", "recreate_pages", "release_pages"])
def test_a_released_handle_never_touches_the_file_now_behind_its_fd(reused, call):
    driver, page, address, old, new = reused
    args = {"discard_pages": ([old], page), "recreate_pages": ([old], page),
            "release_pages": ([old],)}[call]
    with pytest.raises(vmem.DriverCallError, match="released"):
        getattr(driver, call)(*args)
    _new_pages_intact(driver, page, address, new)


def test_creating_no_pages_opens_no_file():
    driver = vmem.open_driver("host")
    before = len(os.listdir("/proc/self/fd"))
    assert driver.create_pages(0, driver.granularity_bytes) == []
    assert len(os.listdir("/proc/self/fd")) == before    # a memfd nothing could release
