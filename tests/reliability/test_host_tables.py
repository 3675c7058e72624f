"""Host tables sized by a ceiling (a vmem pool's page ids up to ``max_cache_bytes`` or a
budget's total, a paged manager's blocks) are checked against the host before any is built."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.errors import CacheTooLargeError

from .conftest import assert_words, mem_total


@pytest.mark.parametrize("how", ["max_cache_bytes", "a memory budget"])
def test_a_pool_ceiling_far_above_the_host_is_refused_before_any_table(model, how):
    """The vmem manager and pool build tables for every page id up to ``max_cache_bytes`` (or
    a shared budget's total) at once, about 600 bytes a page: 10 TB of 64 KiB pages was an OOM
    kill at 24 GB. Now refused first, naming the ceiling, having built nothing (a budget past
    the host's total memory is refused as such, before the tables are looked at)."""
    import tracemalloc

    from vmemkv.runtime.engine import EngineConfigError
    from vmemkv.scheduler.budget import MemoryBudget
    options = (dict(max_cache_bytes=10**13) if how == "max_cache_bytes" else
               dict(memory_budget=MemoryBudget(total_bytes=10**13), cache_bytes=2**20))
    tracemalloc.start()
    try:
        with pytest.raises((CacheTooLargeError, EngineConfigError)) as info:
            Engine(model, page_bytes=65536, **options)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if how == "max_cache_bytes":
        assert info.type is CacheTooLargeError
        assert_words(info.value, ["host tables of 152587890 pool pages", "max_cache_bytes",
                                  str(mem_total())])
    else:
        assert info.type is EngineConfigError
        assert_words(info.value, ["total_bytes (10000000000000)", f"host MemTotal ({mem_total()}"])
    assert peak < 64 * 2**20


def test_make_kv_refuses_paged_tables_past_the_host_before_building_them():
    """make_kv("paged", cache_bytes=10**12) built 122 million blocks' lists (2.1 GB, then a
    bare MemoryError) before anything looked at the host; now refused, nothing built."""
    import tracemalloc

    from vmemkv.runtime.config import CacheConfig
    from vmemkv.runtime.kv import make_kv
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4, max_context=256)
    tracemalloc.start()
    try:
        with pytest.raises(CacheTooLargeError) as info:
            make_kv(config, "paged", cache_bytes=10**12)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_words(info.value, ["host tables of 122070312 blocks", "8192-byte blocks"])
    assert peak < 16 * 2**20
