"""make_cache: a memory manager and the cache that executes it, built to fit each other."""
from __future__ import annotations

from typing import Optional

from vmemkv import vmem
from vmemkv.scheduler.managers import make_manager

from ..config import CacheConfig
from ..errors import CacheConfigError
from .base import KVCache
from .paged_cache import PagedKVCache
from .vmem_cache import VMemKVCache

KiB, MiB = 2**10, 2**20


def default_page_bytes(config: CacheConfig, layout: str) -> int:
    """2 MiB on CUDA (the VMM granularity); on the host the smallest multiple of 64 KiB that
    holds whole tokens of the layout, so small CPU models still get many tokens per page."""
    if config.torch_device.type == "cuda":
        return 2 * MiB
    per_token = config.layer_bytes_per_token * (1 if layout == "per-layer" else config.num_layers)
    page = 64 * KiB
    while page % per_token:
        page += 64 * KiB
    return page


def make_cache(config: CacheConfig, cache: str = "vmem", *, cache_bytes: Optional[int] = None,
               layout: str = "per-layer", page_bytes: Optional[int] = None,
               block_size: int = 16, swap_bytes: int = 0, background_mapper: bool = False,
               driver: Optional[vmem.Driver] = None, grow_pages: bool = False) -> KVCache:
    """Build the manager (scheduler.managers) and its cache for ``config``.

    cache_bytes: device memory for K/V (default: room for every slot at full length).
    vmem: ``layout`` per-layer | interleaved, ``page_bytes`` (default: see default_page_bytes).
    vmem ``grow_pages``: create physical pages on first mapping, up to ``cache_bytes``
    (vmem.PagePool(grow=True)); default: all created up front.
    paged: ``block_size`` tokens per block.
    """
    if cache_bytes is None:
        cache_bytes = config.max_batch * config.max_context * config.bytes_per_token
    model = config.model_spec()
    if cache == "vmem":
        page_bytes = page_bytes or default_page_bytes(config, layout)
        manager = make_manager("vmem", model, cache_bytes, config.max_context, page_bytes=page_bytes,
                               layout=layout, max_slots=config.max_batch, swap_bytes=swap_bytes)
        return VMemKVCache(config, manager, driver=driver, background_mapper=background_mapper,
                           grow_pages=grow_pages)
    if cache == "paged":
        manager = make_manager("paged", model, cache_bytes, config.max_context,
                               block_size_tokens=block_size, swap_bytes=swap_bytes)
        return PagedKVCache(config, manager)
    raise CacheConfigError(f"cache must be 'vmem' or 'paged', got {cache!r}")
