"""A hybrid-pool plan that fails part-way is undone exactly: a fault at EVERY call index of every
driver primitive (map, unmap, copy) of a plan that unmaps window parts, releases them, binds the
released pages to a new group, copies a page group and maps more, leaves bound pages, mapped
parts, range mappings and every mapped byte as before, inline and on the background mapper; the
same plan retried then succeeds."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.errors import MapperPlanError, PlanExecutionError
from vmemkv.scheduler.plan import CopyGroup, GroupPart, MapGroup, ReleaseGroup, UnmapGroup
from vmemkv.vmem import DriverCallError
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..runtime.hybrid_pool import hybrid_cache, kv_of, same, snapshot, write

WINDOW = GroupPart.WINDOW
PLAN = [UnmapGroup(0, 0, 0, WINDOW), UnmapGroup(1, 0, 0, WINDOW), ReleaseGroup(0, WINDOW),
        MapGroup(1, 1, 2), CopyGroup(0, 1, 1, 1), MapGroup(0, 2, 3)]


def scenario(mapper: bool):
    """Slot 0 holds sequence 1 (50 tokens: groups 0, 1); slot 1 shares group 0 at page 0."""
    driver = FaultInjectingDriver(HostDriver())
    cache = hybrid_cache(pool_pages=24, driver=driver, background_mapper=mapper)
    cache.execute([MapGroup(0, 0, 0), MapGroup(0, 1, 1), MapGroup(1, 0, 0)])
    write(cache, 1, 0, 0, 50)
    return cache, driver


@pytest.mark.parametrize("mapper", [False, True], ids=["inline", "mapper"])
@pytest.mark.parametrize("kind", ["map", "unmap", "copy"])
def test_a_fault_at_every_call_index_of_a_part_plan_is_undone_and_a_retry_succeeds(kind, mapper):
    cache, driver = scenario(mapper)
    before, failures = snapshot(cache), 0
    while True:
        driver.fail_at(kind, failures)
        try:
            cache.execute(PLAN)
            cache.wait_for_plan()
        except PlanExecutionError as error:
            assert error.rolled_back and isinstance(error, MapperPlanError) == mapper
            cause = error.__cause__.__cause__ if mapper else error.__cause__
            assert isinstance(cause, DriverCallError)
            assert same(snapshot(cache), before), f"state changed after a fault at {kind} call {failures}"
            cache.check_integrity()
            failures += 1
            continue
        finally:
            driver.disarm()
        break
    assert failures >= 2, f"the plan made only {failures} {kind} calls"
    after = snapshot(cache)
    assert after["bound"] == before["bound"] + 6 + 6 - 4   # groups 2 and 3 bound, 0's window back
    assert after["parts"][1] == {0: {"full": 0}, 1: {"full": 2, "window": 2}}
    k = cache.layer_tensors(1)[0]
    assert torch.equal(k[1, 32:50], kv_of(1, 1, range(32, 50))[0])   # the copied group
    assert torch.equal(cache.read(1, 1, 50)[0], kv_of(1, 1, range(50))[0])
    cache.check_integrity()
    cache.close()
