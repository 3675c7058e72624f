"""A HostDriver used directly refuses an address or a page handle of the wrong kind with a typed
error naming it, before any system call: they failed deep inside as TypeError / AttributeError,
and ``tensor(None, n)`` made a tensor at address 0 that segfaulted when read."""
import pytest

from vmemkv import vmem


@pytest.fixture
def host():
    driver = vmem.open_driver("host")
    page = driver.granularity_bytes
    address = driver.reserve(2 * page)
    (handle,) = driver.create_pages(1, page)
    yield driver, page, address, handle
    driver.release_pages([handle])
    driver.free_reservation(address, 2 * page)


def test_a_tensor_at_no_address_is_refused_instead_of_pointing_at_null(host):
    driver, page, _, _ = host
    for address in (None, "0x1000", 0):
        with pytest.raises(vmem.VMemConfigError, match="address"):
            driver.tensor(address, page)


@pytest.mark.parametrize("call", ["detach", "unmap_if_mapped", "copy"])
def test_an_address_that_is_no_int_is_a_typed_error_and_maps_nothing(host, call):
    driver, page, address, handle = host
    args = {"detach": ("x", handle, page),
            "unmap_if_mapped": ("x", page), "copy": ("x", address, page)}[call]
    with pytest.raises(vmem.VMemConfigError, match="address"):
        getattr(driver, call)(*args)
    driver.map(address, handle, page)          # nothing was mapped: the address is free
    driver.unmap(address, page)


@pytest.mark.parametrize("call", ["map", "detach", "discard_pages", "recreate_pages",
                                  "release_pages"])
def test_a_handle_not_from_create_pages_is_a_typed_error_naming_the_call(host, call):
    driver, page, address, handle = host
    args = {"map": (address, "page0", page), "detach": (address, None, page),
            "discard_pages": (["page0"], page), "recreate_pages": ([3], page),
            "release_pages": ([handle, "page0"],)}[call]
    with pytest.raises(vmem.VMemConfigError, match=f"{call} takes page handles"):
        getattr(driver, call)(*args)
    driver.map(address, handle, page)          # the real page is untouched, its fd open
    driver.tensor(address, page).fill_(5)
    assert int(driver.tensor(address, page).sum()) == 5 * page
    driver.unmap(address, page)
