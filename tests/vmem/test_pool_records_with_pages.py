"""A host pool's pages and its records (vmem/pool.py RECORD_BYTES a page) share the host's
memory: they are checked together. Each alone passed against MemAvailable, so pages taking 97%
of it and records 7% were accepted (/tmp/hunt_vmem/pages_plus_records.py). The records go to
the recent commits with the pages: they show in the reading at once, and left out there they
were taken for pages seen while the memfd pages' share of the reading lagged."""
import pytest

from vmemkv import vmem
from vmemkv.vmem import commits
from vmemkv.vmem.pool import RECORD_BYTES

PAGE = 4096
PAGES = 64
PAGES_BYTES, RECORDS_BYTES = PAGES * PAGE, PAGES * RECORD_BYTES


@pytest.fixture
def host_reading(monkeypatch):
    """A host driver reading ``reading["bytes"]`` available (room for ``PAGES`` pages and half
    of their records unless a test sets it), its recent commits on a clock that never moves."""
    driver = vmem.open_driver("host")
    reading = {"bytes": PAGES_BYTES + RECORDS_BYTES // 2}
    monkeypatch.setattr(driver, "recent_commits", commits.RecentCommits(clock=lambda: 0.0))
    monkeypatch.setattr(driver, "available_bytes", lambda: reading["bytes"])
    return driver, reading


def test_pages_that_fit_only_without_their_records_are_refused_naming_both(host_reading):
    driver, _ = host_reading
    with pytest.raises(vmem.InsufficientMemoryError,
                       match=f"creating {PAGES} pages of {PAGE} bytes \\({PAGES_BYTES} bytes\\) "
                             f"and {RECORDS_BYTES} bytes of records needs "
                             f"{PAGES_BYTES + RECORDS_BYTES} bytes"):
        vmem.PagePool(driver, PAGES, PAGE)
    assert driver.recent_commits.unseen(PAGES_BYTES) == 0     # nothing committed
    with vmem.PagePool(driver, PAGES // 2, PAGE) as pool:      # half: both fit
        with pytest.raises(vmem.InsufficientMemoryError, match="bytes of records"):
            pool.extend(PAGES // 2)
        assert pool.total_pages == pool.committed_pages == PAGES // 2
        pool.check_integrity()


def test_records_shown_at_once_are_never_taken_for_pages_seen(host_reading):
    """A first pool's records show in the reading at once, its memfd pages not yet: a second
    pool of as many pages fits only if the records were pages seen, and is refused (it was
    accepted, counting the first pool's records as its pages' memory)."""
    driver, reading = host_reading
    reading["bytes"] = 2 * (PAGES_BYTES + RECORDS_BYTES) - PAGE    # a page short of two pools
    with vmem.PagePool(driver, PAGES, PAGE):
        reading["bytes"] -= RECORDS_BYTES                          # the records show at once
        with pytest.raises(vmem.InsufficientMemoryError,
                           match=f"needs {PAGES_BYTES + RECORDS_BYTES} bytes .* "
                                 f"{PAGES_BYTES} bytes of it committed by this process"):
            vmem.PagePool(driver, PAGES, PAGE)
        vmem.PagePool(driver, PAGES - 1, PAGE).close()             # a page fewer fits


def test_an_on_demand_pools_chunks_count_only_their_pages(host_reading):
    """Its records exist before any chunk is made: the reading shows them already."""
    driver, reading = host_reading
    reading["bytes"] = 16 * PAGE                                   # one chunk, nothing more
    with vmem.PagePool(driver, PAGES, PAGE, grow=True) as pool:
        rng = vmem.VirtualRange(pool, PAGE)
        rng.map(0, pool.allocate(1)[0])
        assert pool.committed_pages == 16
        assert driver.recent_commits.unseen(reading["bytes"]) == 16 * PAGE
        rng.close()
