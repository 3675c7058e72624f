"""KV caches that execute the scheduler's memory plans: vmem (contiguous) and paged layouts."""
from .base import KVCache, StepBatch
from .paged_cache import PagedKVCache
from .vmem_cache import VMemKVCache

__all__ = ["KVCache", "StepBatch", "VMemKVCache", "PagedKVCache"]
from .factory import default_page_bytes, make_cache  # noqa: E402

__all__ += ["make_cache", "default_page_bytes"]
