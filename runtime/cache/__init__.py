"""KV caches that execute the scheduler's plans: vmem (contiguous) and paged kinds. Pure
executors: built from a CacheConfig and pool sizes, never from a manager (see runtime.kv)."""
from .base import KVCache, StepBatch
from .paged_cache import PagedKVCache
from .vmem_cache import VMemKVCache

__all__ = ["KVCache", "StepBatch", "VMemKVCache", "PagedKVCache"]
