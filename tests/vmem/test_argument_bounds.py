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
