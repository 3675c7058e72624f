"""Issue 17 item 3: a plan waits for queued device work once per op group, not once per page.

The cache announces each op group's unmaps to the driver (``Driver.prepare_unmap(n)``) before
making them; CudaDriver synchronises there and lets those n unmaps skip their own
cuCtxSynchronize (tests/vmem/test_cuda_contract.py checks that side against the real bindings).
Here a recording host driver checks the cache side: the announced count is exactly the number
of unmaps that follow, one announcement per op group, through the fault-injecting wrapper too.
"""
import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.kv import make_kv
from tests.runtime.run_plan import run_plan
from vmemkv.vmem import open_driver
from vmemkv.vmem.faults import FaultInjectingDriver


class RecordingDriver(FaultInjectingDriver):
    """Records ("prepare", n) and "unmap" in call order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.events = []

    def prepare_unmap(self, num_unmaps):
        self.events.append(("prepare", num_unmaps))
        super().prepare_unmap(num_unmaps)

    def unmap(self, address, page_bytes):
        self.events.append("unmap")
        super().unmap(address, page_bytes)


def announced_groups(events):
    """[(announced n, unmaps that followed before the next announcement)]"""
    groups = []
    for event in events:
        if event == "unmap":
            groups[-1][1] += 1
        else:
            groups.append([event[1], 0])
    return [tuple(g) for g in groups]


@pytest.mark.parametrize("head_dim, context, short", [
    (16, 64, 32),      # 128-byte tokens: 32 per 4 KiB page
    (20, 256, 128),    # 160-byte tokens straddle pages: each group member spans 5 pages
])
@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_each_op_group_announces_exactly_the_unmaps_it_makes(layout, head_dim, context, short):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=head_dim, max_batch=4,
                         max_context=context)
    driver = RecordingDriver(open_driver("host"))
    cache = make_kv(config, "vmem", page_bytes=4096, driver=driver, layout=layout.replace("_", "-"),
                    cache_bytes=3 * config.max_context * config.bytes_per_token)
    mgr = cache.manager
    run_plan(mgr, cache, lambda: [mgr.allocate(s, short) for s in range(3)] + [mgr.allocate(3, context)])
    run_plan(mgr, cache, lambda: [mgr.free(s) for s in range(3)])     # pages stay mapped
    driver.events.clear()
    run_plan(mgr, cache, lambda: (mgr.allocate(4, context), mgr.allocate(5, context)))  # reclaims
    groups = announced_groups(driver.events)
    unmaps = driver.events.count("unmap")
    assert unmaps > 0 and all(n == made for n, made in groups)
    assert len(groups) == cache.geometry.num_op_groups
    assert sum(n for n, _ in groups) == unmaps
    cache.close()
