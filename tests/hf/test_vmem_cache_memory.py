"""VMemCache commits physical memory only as rows grow (pages created on first mapping, up to
its budget), reports it in ``stats()``, reads each family's KV-head count from its config, and
refuses use after ``close()`` with a typed error (stats included, and before HF code runs)."""
from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.config import CacheConfig  # noqa: E402
from vmemkv.runtime.errors import CacheStateError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402
from vmemkv.runtime.hf.cache import cache_config_from_model  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

from .. import process_resources  # noqa: E402

# Llama-3-8B's cache shapes: 32 layers, 8 KV heads of 128 dims, fp16 (2 KiB / token / layer)
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)


def test_an_empty_cache_commits_nothing_and_grows_with_its_rows():
    config = CacheConfig(**LLAMA3_8B, max_batch=2, max_context=4096)
    with VMemCache(config) as cache:
        s = cache.stats()
        assert s.committed_bytes == 0 and s.mapped_pages == 0
        assert s.budget_bytes == 2 * 4096 * 32 * 2 * 8 * 128 * 2           # 1 GiB, none of it held
        k = torch.zeros(2, 8, 1, 128, dtype=torch.float16)
        for layer in range(32):
            cache.update(k, k, layer)
        s = cache.stats()
        assert s.mapped_bytes > 0
        assert s.mapped_bytes <= s.committed_bytes <= 1.25 * s.mapped_bytes + 16 * s.page_bytes
        assert s.committed_bytes < s.budget_bytes / 50
        cache.reset()                                   # pages stay mapped and are reused
        for layer in range(32):
            cache.update(k, k, layer)
        assert cache.stats().committed_bytes == s.committed_bytes


def test_a_cache_dropped_without_close_gives_its_memory_back_at_once():
    """As a dropped DynamicCache does: after ``generate``, a VMemCache nobody closed and nobody
    holds leaves no page file, mapping or reservation as soon as it is dropped, with the cycle
    collector off: its layers refer back to it weakly. (They held it strongly: the memory of a
    dropped cache waited for the collector, 9 of 12 caches in a loop of generate calls.)"""
    model = build_model("tiny-llama")
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    gc.collect()
    gc.disable()
    try:
        with process_resources.watch() as watch:
            before = watch.snapshot()
            for _ in range(3):
                cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=64)
                model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache,
                               pad_token_id=0)
                assert watch.snapshot().memfd_fds == before.memfd_fds + 1
                del cache
                assert watch.snapshot(collect=False) == before
    finally:
        gc.enable()


def test_closed_cache_refuses_stats_and_generate_with_a_typed_error():
    model = build_model("tiny-llama")
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=64)
    ids = torch.tensor([[1, 2, 3]])
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                   max_new_tokens=2, do_sample=False)
    cache.close()
    with pytest.raises(CacheStateError, match=r"after close\(\)"):
        cache.stats()
    with pytest.raises(CacheStateError, match=r"after close\(\)") as info:
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                       max_new_tokens=2, do_sample=False)
    # refused at the cache's first query, not after HF has started computing layers
    assert "get_seq_length" in "".join(str(frame) for frame in info.traceback[-2:])
    assert "closed" in repr(cache)


@pytest.mark.parametrize("fields,kv_heads", [
    (dict(multi_query=True), 1),                                       # Falcon-7B style
    (dict(multi_query=False), 4),
    (dict(multi_query=False, num_kv_heads=2), 2),
    (dict(new_decoder_architecture=True, num_kv_heads=2), 4),          # caches K/V expanded
], ids=["multi-query", "multi-head", "grouped", "new-decoder"])
def test_falcon_kv_heads_are_read_as_the_model_caches_them(fields, kv_heads):
    config = transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, **fields)
    assert cache_config_from_model(config, 1, 64).num_kv_heads == kv_heads


def test_gpt_bigcode_multi_query_caches_one_kv_head():
    config = transformers.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=True)
    assert cache_config_from_model(config, 1, 64).num_kv_heads == 1


def test_growth_past_available_memory_is_refused_and_commits_nothing(monkeypatch):
    from vmemkv import vmem
    from vmemkv.runtime.errors import PlanExecutionError
    from vmemkv.vmem.host import HostDriver
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=1, max_context=64)
    with VMemCache(config) as cache:
        monkeypatch.setattr(HostDriver, "available_bytes", lambda self: 100)   # checked per growth
        k = torch.zeros(1, 2, 3, 16)
        with pytest.raises(PlanExecutionError) as info:
            cache.update(k, k, 0)
        assert isinstance(info.value.__cause__, vmem.InsufficientMemoryError)
        assert "100 bytes" in str(info.value) and "available" in str(info.value)
        assert cache.stats().committed_bytes == 0 and cache.stats().mapped_pages == 0


# SmolLM2-135M's cache shapes: 30 layers, 3 KV heads of 64 dims, fp32 (768 bytes / token / layer)
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, max_batch=2, max_context=256)


@pytest.mark.parametrize("layout", ["per-layer", "interleaved", "auto"])
def test_a_narrower_kv_cache_dtype_commits_fewer_bytes_its_pages_holding_the_same_tokens(layout):
    """The default page holds what it would in the model's dtype, so storing K/V in bf16 or int8
    commits half or a quarter of fp32's bytes (one 192 KiB page held 1,024 int8 tokens, and a
    256-token row committed fp32's 22.5 MiB whatever the dtype)."""
    stats, layouts = {}, set()
    for kv_dtype in ("auto", "bf16", "int8"):
        with VMemCache(CacheConfig(**SMOLLM2, kv_cache_dtype=kv_dtype), layout=layout) as cache:
            k = torch.zeros(2, 3, 30, 64)
            for layer in range(30):
                cache.update(k, k, layer)
            stats[kv_dtype] = cache.stats()
            layouts.add(cache.manager.layout().geometry.layout)
    fp32, bf16, int8 = stats["auto"], stats["bf16"], stats["int8"]
    assert len(layouts) == 1                         # "auto" resolves as for the model's dtype
    assert (fp32.page_bytes, fp32.committed_bytes) == (2 * bf16.page_bytes, 2 * bf16.committed_bytes)
    assert (fp32.page_bytes, fp32.committed_bytes) == (4 * int8.page_bytes, 4 * int8.committed_bytes)
    assert fp32.budget_bytes == 4 * int8.budget_bytes


def test_a_layer_of_a_dropped_cache_says_so():
    model = build_model("tiny-llama")
    layer = VMemCache.from_model_config(model.config, max_batch=1, max_context=64).layers[0]
    with pytest.raises(CacheStateError, match="VMemCache was dropped"):
        layer.get_seq_length()
