"""VMemCache's copy (``copy.deepcopy``) and helpers of its update: the room a growth needs,
which families need contiguous K/V."""
from __future__ import annotations

from vmemkv.scheduler.layout import PoolBacking

from .cache_layer import window_offset
from .support import text_config

# families whose attention reshapes the returned K/V with ``view`` (B*H, L, D), which a
# (B, H, L, D) view of the cache's (B, L, H, D) rows cannot give past one row
CONTIGUOUS_KV_FAMILIES = ("gpt_neox_japanese",)


def needs_contiguous_kv(config) -> bool:
    """Whether the model of ``config`` needs ``update`` to return contiguous K/V."""
    return getattr(text_config(config), "model_type", None) in CONTIGUOUS_KV_FAMILIES


def growth_room(cache, batch: int, held: int, end: int) -> tuple:
    """(needed, free, what they count) to grow ``batch`` rows of ``cache`` from ``held`` to
    ``end`` tokens: page groups, or page slices where groups are backed by their bytes."""
    geometry, manager = cache.kv.geometry, cache.manager
    if manager.layout().backing is PoolBacking.BYTES:
        need = batch * (geometry.slot_member_pages(end) - geometry.slot_member_pages(held))
        return need, manager.available_member_pages, \
            f"page slices of {geometry.num_members} pages"
    tpp = cache.kv.tokens_per_page
    need = batch * (-(-end // tpp) - -(-held // tpp))            # page groups
    free = (manager.stats().free_tokens + manager.reclaimable_tokens) // tpp
    return need, free, f"page groups of {tpp} tokens"


def copy_cache(cache, memo):
    """A VMemCache with memory of its own holding ``cache``'s rows: what a later forward can
    read is copied (a windowed layer's keys from the window at ``crop``'s bound on), the 8-bit
    scales with it. A windowed cache's copy grows page by page, giving back what lies behind
    the window as the original did, so it maps the pages the original holds and fits the same
    budget. Its budget is the original's again; close it as any other. It serves the model the
    original was built for as the original does (``VMemCache._bind_model``: a copy unbound let
    a model on the engine's attention write it, and learnt its top layer as a plain cache)."""
    kv = cache.kv
    twin = memo[id(cache)] = type(cache)(cache.config, layout=kv.memory_layout,
                                         page_bytes=kv.page_bytes,
                                         cache_bytes=kv.pool.total_pages * kv.page_bytes)
    if cache._model_config is not None:       # as from_model_config bound the original
        twin._bind_model(cache._model_config)
    batch, held, slid_to = len(cache._rows), cache._held(), cache._slid_to
    if batch and cache.config.layer_windows and slid_to:
        prev = 0
        for end in [*range(kv.tokens_per_page, held, kv.tokens_per_page), held]:
            at = min(prev, slid_to)
            twin._advance(batch, at, end, slide=at > twin._slid_to)
            prev = end
    elif batch:
        twin._advance(batch, 0, held, slide=False)
    if kv.cache.kv_scales is not None:
        mine, its = kv.cache.kv_scales, twin.kv.cache.kv_scales
        its.k.copy_(mine.k)
        its.v.copy_(mine.v)
        its.fixed = list(mine.fixed)
    for index, (layer, end) in enumerate(zip(cache.layers, cache._written)):
        first = min(window_offset(layer.window, slid_to), end)
        for mine, its in zip(kv.layer_tensors(index), twin.kv.layer_tensors(index)):
            its[:batch, first:end].copy_(mine[:batch, first:end])
    twin._written, twin._slid_to = list(cache._written), slid_to
    return twin
