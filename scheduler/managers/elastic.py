"""The vmem pool's elastic half: pages given back to the device and taken back at run time.

The pool's page ids, groups and slots are fixed at construction for ``max_cache_bytes``; the
pages past the current ``cache_bytes`` are held by the ledger's ``RELEASED`` tenant (the
device), so every page is still accounted exactly once. ``resize`` moves pages between the
free list and that tenant:

    grow     released pages back to the free list (no op: the executor creates a page's
             memory when a MapExtent next names it)
    shrink   free pages first, then free groups' (WHOLE keeps pages on them), then the
             reclaimable groups' (still mapped under free slots: UnmapExtent), then the cached
             groups' in the eviction policy's order, then idle adapters' (EvictAdapter); one
             ReleasePages op names them all (``_gather`` over ``_free_one``: the order an
             adapter load takes too).
             Pages that running sequences hold are not touched: the bytes left are returned,
             for the scheduler to preempt and call again (``Scheduler.resize``).
"""
from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from .base import ReleasePages
from .common import check_int
from .kinds import pool_pages_for


class ElasticPool:
    """Mixed into VmemManager: ``capacity_pages``, ``cache_bytes``, ``resize`` (and the pool
    pages at a size, ``_kv_capacity_units``)."""

    def _pages_for(self, cache_bytes: int) -> int:
        return pool_pages_for(cache_bytes, self.page_bytes, self.geometry.num_members,
                              bool(self._win))

    @property
    def capacity_pages(self) -> int:
        """Pool pages in service (free or bound): the pool minus what the device holds."""
        return self.ledger.in_service_pages

    def _kv_capacity_units(self, cache_bytes: Optional[int] = None) -> int:
        """Pool pages in service now, or once resized to ``cache_bytes`` (adapters.py)."""
        if cache_bytes is None:
            return self.capacity_pages
        return min(self._pages_for(cache_bytes), self.pool_pages)

    @property
    def cache_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def resize_step_bytes(self) -> int:
        """Whole slices of every member, or whole pages (``pool_pages_for``)."""
        return self.page_bytes * (1 if self._win else self.geometry.num_members)

    @property
    def max_cache_bytes(self) -> int:
        return self.pool_pages * self.page_bytes

    @property
    def max_sequence_tokens_at_max(self) -> int:
        return min(self.max_seq_len, self._tokens_in_units(self.pool_pages))

    def max_sequence_tokens_at(self, cache_bytes: int) -> int:
        """``max_sequence_tokens`` with the pool resized to ``cache_bytes`` (whole pages, at
        most its max): what a MemoryBudget's reach lets one sequence hold."""
        return min(self.max_seq_len, self._tokens_in_units(self.pool_units(cache_bytes)))

    def resize(self, cache_bytes: int) -> int:
        """As :meth:`MemoryManager.resize`; the bytes returned are whole pages."""
        check_int("cache_bytes", cache_bytes, 0)
        if not self._adapters_share_kv:
            raise ConfigError(f"a vmem pool split statically with adapters "
                              f"(adapter_budget_bytes={self.adapter_budget_bytes}) cannot resize")
        target = self._pages_for(cache_bytes)
        if target > self.pool_pages:
            raise ConfigError(f"cache_bytes={cache_bytes} exceeds this pool's max_cache_bytes="
                              f"{self.max_cache_bytes} (its page ids are fixed at construction:"
                              f" build it with a larger max_cache_bytes)")
        now = self.capacity_pages
        if target >= now:
            self.ledger.restore(target - now)
            return 0
        return (now - target - self._give_to_device(now - target)) * self.page_bytes

    def _give_to_device(self, count: int) -> int:
        """Release up to ``count`` pages nobody holds; returns how many were released."""
        released: list = []
        self._gather(count, lambda n: released.extend(self.ledger.release(n)))
        if released:
            self._ops.append(ReleasePages(tuple(sorted(released))))
        return len(released)

    def _free_one(self) -> bool:
        """Pages nobody holds, freed for ``_gather`` (the device's use, an adapter's): a free
        group's (WHOLE keeps pages on them), else a reclaimable group's (still mapped under
        free slots: UnmapExtent), else a cached group's in the eviction policy's order, else
        an idle adapter's (least recently idle first: EvictAdapter); False when none is left."""
        if self._free:
            self._to_spare(self._free.pop())
        elif self._reclaimable or self._cache:
            self._to_spare(self._reclaim())          # unmapped everywhere, content forgotten
        else:
            return self._evict_adapter_for_kv()
        return True
