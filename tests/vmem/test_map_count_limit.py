"""The host driver stops short of Linux's vm.max_map_count (vmem/map_count.py).

Each mapped page that does not continue its neighbour's memfd page is one memory mapping of the
process. At the limit a map failed as "Cannot allocate memory" with gigabytes free, and from
then on every unmap failed too (the driver unmaps by mapping PROT_NONE over the page), so the
range could never be closed, and malloc of large blocks failed: the process was wedged.
"""
import pytest

from vmemkv import vmem
from vmemkv.vmem.host import meminfo_bytes

from .forking import child_result, in_child

SCATTER = 7919      # a prime: page i maps pool page i * SCATTER % n, never its neighbour's next


def _limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _map_until_refused():
    """In a child: map scattered pages, alternating between two drivers (the limit is the
    process's), until one refuses; then unmap, allocate and close."""
    drivers = [vmem.open_driver("host") for _ in range(2)]
    page = drivers[0].granularity_bytes
    num_pages = _limit() // 2 + 512         # each: more than half the mappings allowed
    pools = [vmem.PagePool(driver, num_pages, page) for driver in drivers]
    ranges = [vmem.VirtualRange(pool, num_pages * page) for pool in pools]
    ids = [pool.allocate(num_pages) for pool in pools]
    refused, index, side = None, 0, 0
    for step in range(2 * num_pages):
        index, side = divmod(step, 2)
        try:
            ranges[side].map(index, ids[side][index * SCATTER % num_pages])
        except vmem.VMemError as error:
            refused = error
            break
    assert isinstance(refused, vmem.DriverCallError), refused
    assert "vm.max_map_count" in str(refused), str(refused)
    assert not ranges[side].is_mapped(index) and ranges[side].num_mapped_pages == index
    for pool in pools:
        pool.check_integrity()
    for unmapped in (index // 2, index - 1, 0):    # room left to unmap, mid-range too
        assert ranges[0].unmap(unmapped) == ids[0][unmapped * SCATTER % num_pages]
    big = bytearray(64 << 20)                   # malloc's own mmap still works
    del big
    for vrange, pool in zip(ranges, pools):
        vrange.close()
        assert pool.mapped_pages == 0
        pool.close()
    return "ok"


@pytest.mark.skipif(_limit() is None or _limit() > 70_000,
                    reason="needs vm.max_map_count readable and near its default 65530")
@pytest.mark.skipif((meminfo_bytes("MemAvailable") or 0) < 2 << 30,
                    reason="needs 2 GiB available for ~300 MiB of pages")
def test_mapping_stops_short_of_max_map_count_so_unmap_and_close_still_work():
    pid, read_end = in_child(_map_until_refused)
    assert child_result(pid, read_end, timeout_s=120) == "'ok'"
