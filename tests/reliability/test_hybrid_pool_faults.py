"""A hybrid-pool plan that fails part-way is undone exactly: a fault at EVERY call index of every
driver primitive (map, unmap, copy) of a plan that unmaps the window kind at two spots, maps
those given-back pool pages at a new spot, copies both kinds' extents and maps more, leaves the
mapped extents, pool pages mapped, range mappings and every mapped byte as before, inline and on
the background mapper; the same plan retried then succeeds."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.errors import MapperPlanError, PlanExecutionError
from vmemkv.scheduler.plan import CopyExtent, MapExtent, UnmapExtent
from vmemkv.vmem import DriverCallError
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..runtime.hybrid_pool import FULL, WINDOW, hybrid_cache, kv_of, same, snapshot, write


def group(slot: int, page_index: int, first: int) -> list:
    """Both kinds' extents at (slot, page_index) on pool pages first..first+5."""
    return [MapExtent(slot, page_index, FULL, (first, first + 1)),
            MapExtent(slot, page_index, WINDOW, tuple(range(first + 2, first + 6)))]


# pool pages 0..5 back page 0 of slots 0 and 1, 6..11 page 1 of slot 0; the plan gives 2..5 (the
# window kind of page 0) to page 1 of slot 1 with 12, 13, copies page 1 there, maps 14..19
PLAN = [UnmapExtent(0, 0, WINDOW), UnmapExtent(1, 0, WINDOW),
        MapExtent(1, 1, FULL, (12, 13)), MapExtent(1, 1, WINDOW, (2, 3, 4, 5)),
        CopyExtent(0, 1, 1, 1, FULL), CopyExtent(0, 1, 1, 1, WINDOW)] + group(0, 2, 14)


def scenario(mapper: bool):
    """Slot 0 holds sequence 1 (50 tokens: page indexes 0, 1); slot 1 shares page 0's pages."""
    driver = FaultInjectingDriver(HostDriver())
    cache = hybrid_cache(pool_pages=24, driver=driver, background_mapper=mapper)
    cache.execute(group(0, 0, 0) + group(0, 1, 6) + group(1, 0, 0))
    write(cache, 1, 0, 0, 50)
    return cache, driver


@pytest.mark.parametrize("mapper", [False, True], ids=["inline", "mapper"])
@pytest.mark.parametrize("kind", ["map", "unmap", "copy"])
def test_a_fault_at_every_call_index_of_an_extent_plan_is_undone_and_a_retry_succeeds(kind, mapper):
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
    assert after["mapped"] == before["mapped"] + 2 + 6      # 12, 13 and 14..19; 2..5 moved
    assert after["extents"][1] == {0: {FULL: (0, 1)}, 1: {FULL: (12, 13), WINDOW: (2, 3, 4, 5)}}
    k = cache.layer_tensors(1)[0]
    assert torch.equal(k[1, 32:50], kv_of(1, 1, range(32, 50))[0])   # the copied full extent
    k0 = cache.layer_tensors(0)[0]
    assert torch.equal(k0[1, 32:50], kv_of(1, 0, range(32, 50))[0])  # and window extent
    assert torch.equal(cache.read(1, 1, 50)[0], kv_of(1, 1, range(50))[0])
    cache.check_integrity()
    cache.close()
