"""A small hybrid per-layer cache (layers 0 and 2 windowed, layer 1 full) driven by hand-written
extent-op plans naming pool pages, with the helpers the executor tests share: writing known K/V
and snapshotting everything the cache holds (mapped extents, pool pages mapped, range mappings
and mapped bytes).

Geometry: 2 KV heads x 16 dims x fp32 = 128 bytes per layer and token; 4 KiB pages hold 32
tokens (k = 1). A page group has 6 members: kind "full" = layer 1's K and V (2 pool pages a page
index), kind "window-8" = layers 0 and 2's K and V (4 pool pages). 2 slots x 128 tokens = 4 page indexes per slot.
"""
from __future__ import annotations

from typing import Optional

import torch

from vmemkv.runtime.cache import VMemKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.plan import SetSlot

KiB = 1024
WINDOWS = (8, None, 8)
TPP = 32                     # tokens per page
FULL_PAGES, WINDOW_PAGES = 2, 4
NUM_GROUPS = 8
FULL, WINDOW = "full", "window-8"
KINDS = ((FULL, (1,)), (WINDOW, (0, 2)))


def hybrid_config(max_batch: int = 2, max_context: int = 128) -> CacheConfig:
    return CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16, max_batch=max_batch,
                       max_context=max_context, layer_windows=WINDOWS)


def hybrid_cache(pool_pages: Optional[int] = 14, driver=None, **options) -> VMemKVCache:
    config = hybrid_config()
    return VMemKVCache(config, PageGeometry.of(config, 4 * KiB, "per-layer"), NUM_GROUPS,
                       driver=driver, pool_pages=pool_pages, kinds=KINDS, **options)


def kv_of(seq: int, layer: int, positions: range) -> tuple:
    """The K and V written for ``seq`` at ``positions`` of ``layer``: [n, 2, 16] each."""
    base = torch.tensor(list(positions), dtype=torch.float32).view(-1, 1, 1)
    k = base + 1000 * seq + 100 * layer + torch.arange(32.0).view(1, 2, 16) / 64
    return k, -k


def write(cache: VMemKVCache, seq: int, slot: int, start: int, end: int) -> None:
    """Place ``seq`` on ``slot`` and write its tokens [start, end) into every layer."""
    cache.apply_tables([SetSlot(seq, slot)])
    cache.begin_step([(seq, start, end - start)])
    for layer in range(cache.config.num_layers):
        cache.write(layer, *kv_of(seq, layer, range(start, end)))


def snapshot(cache: VMemKVCache) -> dict:
    """Everything the cache holds: pool pages mapped, mapped extents per slot, the range's
    mappings (range page -> pool page id) and the bytes of every mapped page."""
    cache.wait_for_plan()
    mapped = cache.range.mapped_pages()
    pb = cache.page_bytes
    return {"mapped": cache.mapped_pool_pages,
            "extents": [cache.mapped_extents(s) for s in range(cache.config.max_batch)],
            "range": mapped,
            "bytes": {pi: cache.range.tensor(pi * pb, pb).clone() for pi in mapped}}


def same(a: dict, b: dict) -> bool:
    return (a.keys() == b.keys() and all(a[k] == b[k] for k in a if k != "bytes")
            and a["bytes"].keys() == b["bytes"].keys()
            and all(torch.equal(a["bytes"][p], b["bytes"][p]) for p in a["bytes"]))
