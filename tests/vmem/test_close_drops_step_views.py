"""Closing a vmem KV cache after a step drops the step's own layer views before the range is
closed. They were kept alive, so the range's close found every mapped page viewed and copied
each into memory of its own (256 MiB copied and held until the cache object was collected, for
a 4,096-token interleaved cache): no page needs a copy when only the cache's views see it."""
from __future__ import annotations

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.kv import make_kv
from vmemkv.vmem.host import HostDriver


class CountingHost(HostDriver):
    """The host driver, counting the pages a close copies (detaches) for live views."""

    def __init__(self) -> None:
        super().__init__()
        self.detached = 0

    def detach(self, *args, **kwargs) -> bool:
        self.detached += 1
        return super().detach(*args, **kwargs)


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_a_closed_cache_copies_no_page_for_its_own_step_views(layout):
    driver = CountingHost()
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=256)
    kv = make_kv(config, "vmem", layout=layout, page_bytes=4096, driver=driver)
    kv.manager.allocate(0, 200)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(0, 0, 1)])                        # builds every layer's view
    assert kv.cache.pool.mapped_pages > 0
    kv.close()
    assert driver.detached == 0
    assert kv.cache.pool.held_pages == 0
    driver.close()


def test_a_view_the_caller_keeps_is_still_copied_and_keeps_its_bytes():
    driver = CountingHost()
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, max_batch=1, max_context=256)
    kv = make_kv(config, "vmem", page_bytes=4096, driver=driver)
    kv.manager.allocate(0, 64)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(0, 0, 64)])
    kept = kv.cache.range.tensor(0, 4096)             # a caller's own view of the first page
    kept.fill_(7)
    kv.close()
    assert driver.detached >= 1 and bool((kept == 7).all())
    del kept
    driver.close()
