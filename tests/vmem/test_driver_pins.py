"""Pins on the Driver interface's shared code (vmem/driver.py) and the fault-injecting wrapper
(vmem/faults.py): what each promises in its docstring, checked through the host driver."""
import pytest

from vmemkv import vmem
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

PAGE = 4096


@pytest.fixture
def wrapped():
    """A FaultInjectingDriver (it keeps Driver's default unmap_if_mapped) over a host driver,
    with a 2-page reservation and one page; everything given back after."""
    driver = FaultInjectingDriver(HostDriver())
    base = driver.reserve(2 * PAGE)
    (page,) = driver.create_pages(1, PAGE)
    yield driver, base, page
    for address in (base, base + PAGE):
        driver.inner.unmap_if_mapped(address, PAGE)
    driver.free_reservation(base, 2 * PAGE)
    driver.release_pages([page])


def test_the_default_unmap_if_mapped_says_whether_anything_was_mapped(wrapped):
    """Driver.unmap_if_mapped (CUDA's and the wrapper's): True when it unmapped, False when the
    driver refused because nothing was there, and the address is then free to map again."""
    driver, base, page = wrapped
    assert driver.unmap_if_mapped(base, PAGE) is False
    driver.map(base, page, PAGE)
    assert driver.unmap_if_mapped(base, PAGE) is True
    assert driver.unmap_if_mapped(base, PAGE) is False
    driver.map(base, page, PAGE)                              # unmapped for real
    assert driver.mapped_addresses == 1


def test_unseen_commits_count_the_readings_drop_since_the_first_of_them():
    """RecentCommits: what the reading has not shown yet is the recent commits less how far the
    reading dropped since just before the OLDEST of them (vmem/commits.py)."""
    from vmemkv.vmem import commits
    ledger = commits.RecentCommits(clock=lambda: 0.0)      # no window expires: no timing
    ledger.committed(100, available_before=1000)
    assert ledger.unseen(950) == 50                          # 50 of the 100 show
    ledger.committed(200, available_before=950)
    assert ledger.unseen(950) == 250                         # 300 committed, 50 shown
    assert ledger.unseen(700) == 0                           # all 300 show: forgotten


def test_bytes_given_back_cancel_the_newest_commits_first():
    """RecentCommits.released: the newest commits stop counting first, so once the older
    commit's window ends nothing is left unseen."""
    from vmemkv.vmem import commits
    now = [0.0]
    ledger = commits.RecentCommits(window_s=5.0, clock=lambda: now[0])
    ledger.committed(100, available_before=1000)            # at 0 s
    now[0] = 4.0
    ledger.committed(100, available_before=1000)            # at 4 s
    ledger.released(100)                                    # the one at 4 s goes
    now[0] = 4.5
    assert ledger.unseen(1000) == 100                       # the one at 0 s, in its window
    now[0] = 5.5
    assert ledger.unseen(1000) == 0                         # its window ended


def test_work_handed_in_during_a_call_runs_as_the_call_ends_not_inside_it():
    """DrainingLock: work submitted while a call holds the lock (a view's deleter run by the
    collector inside it) waits for the outermost ``with`` to end, then runs at once: nothing
    waits in the queue while no thread holds the lock."""
    from vmemkv.vmem.commits import DrainingLock
    lock, ran = DrainingLock(), []
    with lock:
        with lock:
            lock.submit(lambda: ran.append("work"))
        assert ran == []                                      # never in the middle of a call
    assert ran == ["work"]


def test_a_fault_is_counted_from_the_moment_it_is_armed(wrapped):
    """fail_at(kind, 0): the NEXT call of that kind fails, however many came before."""
    driver, base, page = wrapped
    driver.map(base, page, PAGE)
    driver.unmap(base, PAGE)
    driver.fail_at("map", 0)
    with pytest.raises(vmem.DriverCallError, match="map: injected fault at call 1"):
        driver.map(base, page, PAGE)
    assert driver.faults_raised["map"] == 1 and driver.mapped_addresses == 0
    driver.map(base, page, PAGE)                              # one fault only


def test_a_map_the_real_driver_refuses_leaves_the_address_unmapped_in_the_wrapper(wrapped):
    """The wrapper's own record of mapped addresses follows the real driver: a refused map
    is not recorded, so mapping the address properly next is no double map."""
    driver, base, page = wrapped
    with pytest.raises(vmem.DriverCallError, match="the page holds 4096 bytes"):
        driver.map(base, page, 2 * PAGE)                      # past the page: refused
    assert driver.mapped_addresses == 0
    driver.map(base, page, PAGE)
    assert driver.double_maps == 0 and driver.mapped_addresses == 1


def test_a_detached_address_is_no_longer_a_mapping_in_the_wrapper(wrapped):
    """After detach the address holds the process's own copy, no pool page: the wrapper
    forgets it, so the page can be mapped there again (no false double map)."""
    driver, base, page = wrapped
    driver.map(base, page, PAGE)
    driver.tensor(base, PAGE).fill_(5)
    assert driver.detach(base, page, PAGE) is True
    assert driver.mapped_addresses == 0 and driver.tensor(base, PAGE).eq(5).all()
    driver.map(base, page, PAGE)
    assert driver.double_maps == 0 and driver.mapped_addresses == 1


def test_a_refused_driver_call_is_an_os_error_as_well_as_a_vmem_error(wrapped):
    """DriverCallError: code that catches OSError around system calls catches it too."""
    driver, base, page = wrapped
    for catch in (OSError, vmem.VMemError):
        with pytest.raises(catch, match="no mapping of 4096 bytes starts there"):
            driver.inner.unmap(base, PAGE)
