"""Host driver: reservations cost no memory, unmapped memory faults, cycles leak nothing."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

from vmemkv import vmem

from .. import process_resources

GiB = 2**30


def range_rss_bytes(address):
    """Resident bytes of the /proc/self/smaps entries that lie inside a range from ``address``."""
    rss_kib, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start >= address and start < address + 64 * GiB
            elif inside and fields[0] == "Rss:":
                rss_kib += int(fields[1])
    return rss_kib * 1024


def process_rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_64_gib_reservation_costs_no_memory_until_mapped():
    driver = vmem.open_driver("host")
    page_bytes = 2 * 2**20
    rss_before = process_rss_bytes()
    with vmem.PagePool(driver, 4, page_bytes) as pool, vmem.VirtualRange(pool, 64 * GiB) as rng:
        assert rng.size_bytes == 64 * GiB  # more than this 24 GiB machine has
        assert range_rss_bytes(rng.address) == 0
        assert process_rss_bytes() - rss_before < 64 * 2**20
        pages = pool.allocate(4)
        for i, page in enumerate(pages):  # scattered across the 64 GiB
            rng.map(i * (rng.num_pages // 4), page)
            rng.tensor(i * (rng.num_pages // 4) * page_bytes, page_bytes).fill_(1)
        # exactly the four touched pages are resident inside the range
        assert range_rss_bytes(rng.address) == 4 * page_bytes
        for i in range(4):
            rng.unmap(i * (rng.num_pages // 4))
        assert range_rss_bytes(rng.address) == 0


def test_10000_map_unmap_cycles_leave_no_fds_or_mappings():
    driver = vmem.open_driver("host")
    page_bytes = 64 * 2**10
    with process_resources.watch() as watch:
        before = watch.snapshot()
        with vmem.PagePool(driver, 8, page_bytes) as pool, \
                vmem.VirtualRange(pool, 32 * page_bytes) as rng:
            pages = pool.allocate(8)
            for cycle in range(10_000):
                index, page = (cycle * 7) % 32, pages[cycle % 8]
                rng.map(index, page)
                rng.unmap(index)
            assert rng.num_mapped_pages == 0 and pool.mapped_pages == 0
            assert watch.snapshot().memfd_mappings == before.memfd_mappings   # all unmapped
            assert watch.snapshot().live_reservations == 1
            for page in pages:
                pool.release(page)
        assert watch.snapshot() == before


def test_pools_and_ranges_created_and_closed_leave_nothing_behind():
    driver = vmem.open_driver("host")
    with process_resources.watch() as watch:
        before = watch.snapshot()
        for cycle in range(200):
            with vmem.PagePool(driver, 2, 4096) as pool, vmem.VirtualRange(pool, 8192) as rng:
                rng.map(1, pool.allocate(1)[0])
                if cycle == 0:   # the check can see what is there
                    live = watch.snapshot()
                    assert (live.memfd_mappings, live.memfd_fds, live.live_reservations) == \
                        (before.memfd_mappings + 1, before.memfd_fds + 1, 1)
        assert watch.snapshot() == before and len(watch.reserved) == 200


def test_pools_and_ranges_dropped_without_close_leave_nothing_behind():
    """As a dropped torch tensor frees its memory: a range unmaps and frees its reservation, a
    pool destroys its pages, whether dropped one by one, in one garbage cycle, or with the pool
    finalized first while the range still maps it (the cycle collector picks the order)."""
    driver = vmem.open_driver("host")
    with process_resources.watch() as watch:
        before = watch.snapshot()
        for way in ("refcount", "cycle", "pool first"):
            pool = vmem.PagePool(driver, 4, 4096)
            rng = vmem.VirtualRange(pool, 4 * 4096)
            for index, page in enumerate(pool.allocate(3)):
                rng.map(index, page)
            rng.tensor(0, 3 * 4096).fill_(1)
            pool.discard(pool.allocate(1))
            if way == "cycle":
                pool.cycle = rng
            elif way == "pool first":
                pool.__del__()
                assert pool.closed and rng.num_mapped_pages == 3   # nothing else touched
            del pool, rng
            gc.collect()
            assert watch.snapshot() == before, way


def test_the_watch_counts_a_reservation_beside_a_foreign_prot_none_mapping_and_not_its_reuse():
    """glibc's heap tails are private anonymous PROT_NONE MAP_NORESERVE mappings, the flags of a
    reservation; the kernel merged one with a cache's reservation in a CI run, and the watch,
    which looked for a line starting at the reserved address, counted the live cache as gone.
    Here the reservation is placed (by an mmap hint) right above such a mapping."""
    from vmemkv.vmem import host
    libc = host._load_libc()
    foreign_flags = host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE
    prot_none, fixed_noreplace = host.PROT_NONE, 0x100000
    size = 1 << 20
    foreign = libc.mmap(None, 2 * size, prot_none, foreign_flags, -1, 0)
    assert foreign not in (None, host.MAP_FAILED)
    libc.munmap(foreign + size, size)          # a hole of the reservation's size above it

    class Hinted:        # the driver's libc, its reservation's mmap hinted into the hole
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def mmap(self, address, *rest):
            return self.real.mmap(foreign + size if address is None else address, *rest)

    driver = vmem.open_driver("host")
    driver._libc = Hinted(driver._libc)
    try:
        with process_resources.watch() as watch:
            with vmem.PagePool(driver, 1, 4096) as pool, vmem.VirtualRange(pool, size) as rng:
                assert rng.address == foreign + size
                assert watch.snapshot().live_reservations == 1
            assert watch.snapshot().live_reservations == 0
            hole = foreign + size     # an allocator's mapping in the freed range ...
            assert libc.mmap(hole, size, prot_none, foreign_flags | fixed_noreplace, -1, 0) == hole
            assert watch.snapshot().live_reservations == 0      # ... is not ours
    finally:
        libc.munmap(foreign, 2 * size)


FAULT_SCRIPT = textwrap.dedent("""
    import torch, vmem
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 1, 4096)
    rng = vmem.VirtualRange(pool, 2 * 4096)
    rng.map(0, pool.allocate(1)[0])
    rng.tensor(0, 4096).fill_(1)
    print("mapped page read ok", flush=True)
    {action}
    print("UNREACHABLE", flush=True)
""")


def run_fault_script(action):
    code = FAULT_SCRIPT.format(action=action)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_reading_an_unmapped_page_faults_instead_of_reading_zeros():
    result = run_fault_script("print(rng.tensor(4096, 4096).sum())")
    assert "mapped page read ok" in result.stdout
    assert "UNREACHABLE" not in result.stdout
    assert result.returncode == -11  # SIGSEGV: the page is really PROT_NONE


def test_reading_an_unmapped_again_page_faults():
    result = run_fault_script("rng.unmap(0); print(rng.tensor(0, 4096).sum())")
    assert result.returncode == -11 and "UNREACHABLE" not in result.stdout


def test_a_file_descriptor_limit_is_a_driver_call_error_naming_memfd_create():
    """``ulimit -n`` exhausted: each pool needs one memfd; the OSError (EMFILE) becomes a typed
    DriverCallError, and nothing is created."""
    import resource
    driver = vmem.open_driver("host")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)              # a new fd takes the lowest free number, which the
    os.close(lowest_free)                # soft limit bounds: no new fd at all under it
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        try:
            vmem.PagePool(driver, 2, 4096)
        except vmem.DriverCallError as error:
            refused = str(error)
        else:
            refused = ""
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "memfd_create" in refused and "errno 24" in refused
