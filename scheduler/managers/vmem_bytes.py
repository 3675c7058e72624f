"""ByteMappedVmemManager: the vmem manager where a page-group member spans k > 1 pages (a page
does not hold whole tokens) and a group is backed only by the pages its tokens' bytes need.

The page group stays the unit of everything else (prefix keys, sharing, copy-on-write, window
release, page indices; see scheduler.geometry), so this class only adds a BACKING per group:
``backing(g)`` = m, each member's first m of its k pages. The pool is counted in SLICES of
``num_members`` pages (one page of each member: ``pool_slices``), taken from and given back to
the page ledger as a group's backing grows and shrinks (MapExtent of the new member pages, or
UnmapExtent of the dropped ones, wherever the group is mapped), and

    held group (refs >= 1)     m == member_pages_for(fill): the pages covering its bytes
    cached group               m == k (it is full)
    reclaimable group          m >= 1, what it had (deferred reclamation keeps it mapped)
    free group                 m == 0 (group ids are plentiful: one per pool slice)

so a sequence of n tokens alone on its slot holds members x ceil(n x token_bytes / page_bytes)
pages. Every mapping of a group maps exactly its backed pages. Backing grows only when free
slices suffice, reclaiming the least recently used reclaimable group, then the cached one the
eviction policy names, until they do; within one call shrinking runs before growing, so the
slices a call frees serve its own growth.
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..errors import ConfigError, OutOfCapacityError
from ..layout import PoolBacking
from .base import MapExtent, MemoryStats, UnmapExtent
from .journal import JList
from .prefix import HeldSeq
from .vmem import VmemManager


class ByteMappedVmemManager(VmemManager):
    """VmemManager over a pool of ``pool_slices`` slices (``pool_pages`` pages) whose groups are
    backed by bytes (``make_manager("vmem", ...)`` builds one when ``geometry.exact`` is False
    and groups are not split by layer kind). Guarantees, on top of VmemManager's: slices bound
    <= ``pool_slices``; a held group is backed exactly as far as its tokens need."""

    def __init__(self, model, cache_bytes: int, max_seq_len_tokens: int, **kwargs) -> None:
        super().__init__(model, cache_bytes, max_seq_len_tokens, **kwargs)
        if self.geometry.exact or self.geometry.split:
            raise ConfigError(
                f"ByteMappedVmemManager needs members spanning several pages and groups not split "
                f"by layer kind; got {self.geometry.pages_per_member} page(s) per member"
                f"{', split' if self.geometry.split else ''} (make_manager picks the manager)")
        self._backed = JList(self._cell, [0] * self.num_groups)   # group -> member pages
        self._idle = 0                              # sum of _backed over reclaimable groups

    def _pool(self, cache_bytes: int, whole_groups: int) -> tuple:
        self.pool_slices = cache_bytes // (self.page_bytes * self.geometry.num_members)
        return self.pool_slices, self.pool_slices * self.geometry.num_members  # a group with
                                                                   # a token holds >= 1 slice
    def _back_fixed(self) -> None:
        """Nothing is backed before its bytes are (``_back``)."""

    @property
    def _bound(self) -> int:
        """Slices bound to groups (the ledger's pages taken, in slices)."""
        return (self.pool_pages - self.ledger.free_pages) // self.geometry.num_members

    def _smallest_unit(self) -> tuple:
        return "page slice (a page of each member)", self.geometry.num_members

    pool_backing = PoolBacking.BYTES

    _FIXED_FIELDS = VmemManager._FIXED_FIELDS | {"pool_slices"}
    _SAVED_FIELDS = VmemManager._SAVED_FIELDS + ("_idle",)
    _JOURNALED_FIELDS = VmemManager._JOURNALED_FIELDS | {"_backed"}

    # -- page accounting --
    def backing(self, group: int) -> int:
        """Pages of each member of ``group`` that are backed (0..pages_per_member)."""
        return self._backed[group]

    @property
    def bound_pages(self) -> int:
        """Pool pages bound to some group."""
        return self._bound * self.geometry.num_members

    def _idle_slices(self) -> int:
        """Slices of groups nobody holds but that keep pages (reclaimable, cached)."""
        return self._idle + len(self._cache) * self.geometry.pages_per_member

    @property
    def available_member_pages(self) -> int:
        """Slices (one page of each member) an allocation may take: unbound ones, and those
        of groups nobody holds."""
        return self.pool_slices - self._bound + self._idle_slices()

    def _available_units(self) -> int:
        return self.available_member_pages

    def _units_as_tokens(self, units: int) -> int:
        return self.geometry.tokens_in_member_pages(units)

    def _need(self, num_tokens: int, hits: list) -> int:
        revived = sum(1 for g in hits if self._refs[g] == 0)
        k = self.geometry.pages_per_member
        return self.geometry.slot_member_pages(num_tokens) - (len(hits) - revived) * k

    def _growth(self, seq: HeldSeq, num_tokens: int) -> int:
        """Slices ``append`` takes: the sequence's new bytes, plus a copy of a shared partial
        last group's backing (copy-on-write)."""
        n, geo = seq.num_tokens, self.geometry
        need = geo.slot_member_pages(n + num_tokens) - geo.slot_member_pages(n)
        if n % self.tokens_per_page and num_tokens and self._refs[seq.units[-1]] > 1:
            need += self._backed[seq.units[-1]]
        return need

    def _fresh_units(self, seq: HeldSeq) -> Optional[int]:
        if not self._free_slots:
            return None
        return self.geometry.slot_member_pages(seq.num_tokens)

    @property
    def max_sequence_tokens(self) -> int:
        k, geo = self.geometry.pages_per_member, self.geometry
        whole, rest = divmod(self.pool_slices, k)
        return min(self.max_seq_len, whole * self.tokens_per_page + geo.tokens_in_member_pages(rest))

    # -- backing --
    def _back(self, g: int, pages: int, owner: Optional[int] = None) -> None:
        """Back each member of ``g`` by its first ``pages`` pages, mapped or unmapped wherever
        ``g`` is mapped (the MapExtents serve ``owner``, the sequence holding ``g``), reclaiming
        unheld groups first when too few slices are unbound (room was checked)."""
        old, m, kind = self._backed[g], self.geometry.num_members, self.kinds[0].name
        if pages == old:
            return
        while pages - old > self.pool_slices - self._bound:
            self._reclaim_one()
        extent = self._extents[0][g]
        if pages > old:
            new = self.ledger.take((pages - old) * m, kind)
            self._extents[0][g] = extent + new
            self._ops.extend(MapExtent(slot, pi, kind, new, old, owner=owner)
                             for slot, pi in sorted(self._maps[g]))
        else:
            self._ops.extend(UnmapExtent(slot, pi, kind, pages) for slot, pi in sorted(self._maps[g]))
            self._extents[0][g] = extent[:pages * m]
            self.ledger.give(extent[pages * m:])
        self._backed[g] = pages

    def _reclaim_one(self) -> None:
        """Unmap and free the least recently used reclaimable group, else evict a cached one."""
        if self._reclaimable:
            g = self._reclaimable.pop_first()
            self._idle -= self._backed[g]
        else:
            g = self._evict()
        self._unmap_everywhere(g)
        self._free.append(g)
        self._back(g, 0)

    def _fit(self, groups: Iterable[int], owner: int) -> None:
        """Back ``groups`` held by ``owner`` as their fill needs: shrinking first, so growth
        can use it."""
        want = [(g, self.geometry.member_pages_for(self._fill[g])) for g in groups
                if g is not None]
        for g, pages in want:
            if pages < self._backed[g]:
                self._back(g, pages, owner)
        for g, pages in want:
            if pages > self._backed[g]:
                self._back(g, pages, owner)

    def _copy_backing(self, dst: int, src: int, owner: Optional[int]) -> None:
        self._back(dst, self._backed[src], owner)

    def _place(self, seq_id: int, seq: HeldSeq, hits: list, slot: Optional[int] = None) -> None:
        super()._place(seq_id, seq, hits, slot)
        self._fit(seq.units[len(hits):], seq_id)

    def _append_slow(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        first = max(seq.num_tokens - 1, 0) // self.tokens_per_page
        super()._append_slow(seq_id, seq, num_tokens, token_ids)
        self._fit(seq.units[first:], seq_id)

    def append(self, seq_id: int, num_tokens: int = 1, token_ids=None) -> None:
        """As VmemManager's; the counters-only hot path only while the new tokens fit the last
        group's backed pages."""
        seq = self._seq(seq_id)
        units, tpp = seq.units, self.tokens_per_page
        if units and seq.num_tokens + num_tokens <= (len(units) - 1) * tpp + \
                self.geometry.tokens_in_member_pages(self._backed[units[-1]]):
            super().append(seq_id, num_tokens, token_ids)
            return
        if self._cell.j is not None:     # (not _append_logged: its hot path would not back)
            self._cell.j.record(seq)
        self._append_slow(seq_id, seq, num_tokens, token_ids)

    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        if seq.num_tokens + num_tokens > self.max_seq_len:
            return False
        need = self._growth(seq, num_tokens)
        return need <= self.pool_slices - self._bound or need <= self._available_units()

    # -- groups entering or leaving the reclaimable LRU (_idle), or free (no slices) --
    def _unheld(self, g: int) -> None:
        super()._unheld(g)
        if self._maps[g]:
            self._idle += self._backed[g]      # reclaimable: keeps its pages, still mapped
        else:
            self._back(g, 0)

    def _unmap(self, slot: int, pi: int, kinds=None) -> None:
        g = self._pages[slot][pi]
        was = g in self._reclaimable
        super()._unmap(slot, pi, kinds)
        if was and g not in self._reclaimable:
            self._idle -= self._backed[g]
        if not self._refs[g] and not self._maps[g] and g not in self._cache:
            self._back(g, 0)

    def _take_group(self) -> int:
        if not self._free and self._reclaimable:      # VmemManager takes the LRU one
            self._idle -= self._backed[self._reclaimable.first()]
        return super()._take_group()

    def _revive(self, g: int) -> None:
        if g in self._reclaimable:
            self._idle -= self._backed[g]
        super()._revive(g)

    def _grow_page(self, slot: int, pi: int) -> int:
        g = self._pages[slot].get(pi)
        if g is not None and g in self._reclaimable:  # reused where it is mapped
            self._idle -= self._backed[g]
        return super()._grow_page(slot, pi)

    # -- queries --
    @property
    def reclaimable_tokens(self) -> int:
        return self.geometry.tokens_in_member_pages(self._idle_slices())

    def kv_cache_usage(self) -> float:
        """Slices bound to held groups over the pool (unheld groups' slices count as free)."""
        return (self._bound - self._idle_slices()) / self.pool_slices

    def stats(self) -> MemoryStats:
        """Tokens as the pages hold them (bytes = tokens * bytes_per_token, rounded down):
        ``total_tokens`` is the pool, ``allocated_tokens`` its bound slices, ``end_waste_tokens``
        the held pages' room past the live tokens."""
        tokens = self.geometry.tokens_in_member_pages
        total, allocated = tokens(self.pool_slices), tokens(self._bound)
        held = tokens(self._bound - self._idle_slices())
        return MemoryStats(total_tokens=total, allocated_tokens=allocated,
                           live_tokens=self._live, free_tokens=total - allocated,
                           end_waste_tokens=max(held - self._live, 0),
                           bytes_per_token=self.bytes_per_token)

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(
            f"{what}: {self.pool_slices - self._bound} of {self.pool_slices} page slices "
            f"({self.geometry.num_members} pages each) unbound, {self._idle_slices()} in "
            f"{len(self._reclaimable)} reclaimable + {len(self._cache)} cached page groups, "
            f"{len(self._free_slots)} free slots")

    # -- integrity (VmemIntegrity hook) --
    def _check_parts(self, refs: list, maps: list) -> None:
        geo, cached = self.geometry, set(self._cache)
        self.ledger.check_integrity()
        assert self._bound == sum(self._backed) <= self.pool_slices, "slices bound"
        assert all(len(self._extents[0][g]) == self._backed[g] * geo.num_members
                   for g in range(self.num_groups)), "extents hold the backed pages"
        assert self._idle == sum(self._backed[g] for g in self._reclaimable), "reclaimable slices"
        for g in range(self.num_groups):
            m = self._backed[g]
            if refs[g]:
                assert m == geo.member_pages_for(self._fill[g]), ("held backing", g, m)
            elif g in cached:
                assert m == geo.pages_per_member, ("cached backing", g, m)
            elif maps[g]:
                assert 1 <= m <= geo.pages_per_member, ("reclaimable backing", g, m)
            else:
                assert m == 0, ("free group keeps pages", g, m)
