"""``make_kv``'s KV pairing pinned at its limits: a step or a read one token past what the
manager holds is refused, even where the cache's block would have room for it."""
from __future__ import annotations

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.kv import make_kv


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_writes_and_reads_stop_at_the_tokens_the_manager_holds(kind):
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, max_batch=1, max_context=64)
    with make_kv(config, kind, block_size=16) as kv:
        kv.manager.allocate(0, 10)
        kv.execute(kv.manager.take_ops())
        with pytest.raises(CacheStateError, match="writing tokens up to 11 but the manager holds 10"):
            kv.begin_step([(0, 0, 11)])
        with pytest.raises(CacheStateError, match="holds 10 tokens, asked to read 11"):
            kv.read(0, 0, 11)
        kv.begin_step([(0, 0, 10)])        # the held tokens themselves are written and read
        k, v = kv.read(0, 0, 10)
        assert k.shape[0] == v.shape[0] == 10


def test_the_vmem_default_page_holds_the_same_tokens_whatever_the_kv_cache_dtype():
    from vmemkv.runtime.kv import default_page_bytes, same_tokens_page_bytes
    fp32 = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_context=256)
    page = default_page_bytes(fp32, "per-layer")
    assert same_tokens_page_bytes(fp32, "per-layer") == page
    for name, divisor in (("int8", 4), ("fp8_e4m3", 4), ("bf16", 2)):
        config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_context=256,
                             kv_cache_dtype=name)
        assert same_tokens_page_bytes(config, "per-layer") == page // divisor


def test_a_paged_cache_refuses_a_max_cache_bytes_it_could_never_grow_to():
    from vmemkv.runtime.errors import CacheConfigError
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, max_batch=1, max_context=64)
    cache_bytes = 64 * config.bytes_per_token
    with pytest.raises(CacheConfigError, match="max_cache_bytes needs the vmem cache"):
        make_kv(config, "paged", cache_bytes=cache_bytes, max_cache_bytes=2 * cache_bytes)
    with make_kv(config, "paged", cache_bytes=cache_bytes, max_cache_bytes=cache_bytes) as kv:
        assert kv.manager.can_allocate(64)
