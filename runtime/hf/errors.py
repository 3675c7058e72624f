"""VMemCache's typed errors (re-exported by runtime.hf.cache). Each is raised before the update
that triggers it writes anything: the cache holds what it held."""
from __future__ import annotations

from ..errors import CacheStateError


class BatchTooLargeError(CacheStateError):
    """A batch has more rows than the cache's ``max_batch`` slots."""


class ContextOverflowError(CacheStateError):
    """A sequence would grow past the cache's ``max_context`` tokens."""


class CacheCapacityError(CacheStateError, MemoryError):
    """The physical page budget (``cache_bytes``) cannot hold the batch at the asked length."""

