"""The per-kind half of VmemManager (vmem.py): how a page group's extents are backed (the
backing rule) and which kinds are given back behind the window (the release rule), over the
manager's ``KindTable`` and its one PageLedger. Room is counted in pool pages.

Backing rule (``PoolBacking``, from the geometry):
    WHOLE   a group taken for new content binds one page of every member of every kind; a free
            group keeps its pages (``_free``) and a spare id has none (``_spare``).
    BYTES   a held group is backed by ``member_pages_for(fill)`` pages of every member,
            grown (MapExtent from ``first_page``) and shrunk (UnmapExtent from ``first_page``)
            wherever it is mapped, reclaiming unheld groups first when the ledger is short; a
            reclaimable group keeps what it had, a cached one is whole, a free one has none.
            Within one call shrinking runs before growing, so a call's freed pages serve it.

Release rule (the kinds; ``_win``: the windowed kinds beside a full one):
    A mapping (slot, pi) -> g carries every kind, except below a live slot's window frontier
    ``_win_gone[slot]``, where its owner unmapped the windowed kinds and only the others stay.
    A group's windowed kinds are released (pages back to the ledger, prefix registration
    dropped: an incomplete group is never a hit) as soon as every holder dropped them
    (``_win_drop[g] == refs[g]``), after unmapping their whole mappings elsewhere; a partial
    group (``_partial``) whose last holder goes gives back the rest and becomes spare. Hits
    run from a prompt's first page, so the registrations chained below it go with its own
    (``ChainedPrefixIndex``), as below an evicted group: cached groups among them are given back.

Ops (a split hybrid: kind 0 "full", kind 1 "window-W"; each names the kind's pool pages):
    MapExtent(s, pi, "full", pages) + MapExtent(s, pi, "window-W", pages)   a whole mapping
    MapExtent(s, pi, "full", pages)       full only (a fork of a sequence behind its window)
    UnmapExtent(s, pi, "window-W")        the window kind leaves that mapping; full stays
CopyExtent, SwapOut and SwapIn only ever name whole mappings.
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..layout import PoolBacking
from ..errors import OutOfCapacityError
from .base import MapExtent, MemoryStats, UnmapExtent
from .journal import JList, JSet
from .prefix import ChainedPrefixIndex, HeldSeq, drop_cached_chain
from .units import UnitOps
from .window import dropped_units


class KindRules:
    """Mixed into VmemManager: the backing and release rules over ``table`` (KindTable)."""

    def _init_rules(self, cell) -> None:
        geo, table = self.geometry, self.table
        self._whole = self._plain_append = self.backing is PoolBacking.WHOLE
        self._win_pages = sum(table.members[k] for k in self._win) * geo.pages_per_member
        self._kept = tuple(k for k in range(len(self.kinds)) if k not in self._win)
        self._idle = 0                                   # pages of reclaimable groups
        self._partial = JSet(cell)                       # held, windowed kinds released
        self._win_drop = JList(cell, [0] * self.num_groups)  # holders of g, windowed unmapped
        self._win_gone = JList(cell, [0] * self.num_slots)   # slot -> leading pages, windowed gone
        self.prefix = ChainedPrefixIndex(cell)          # a registration never outlives its parent
        if self._whole and not self._win:     # groups never give pages back: bound for good
            bound = min(self.num_groups, self.ledger.free_pages // self.pages_per_group)
            self._spare = JList(cell, range(self.num_groups - 1, bound - 1, -1))  # released
            self._free = JList(cell, range(bound - 1, -1, -1))
            for g in range(bound):
                self._back_all(g, geo.pages_per_member)
            return
        self._free = JList(cell)                          # no group has pages before it is taken
        self._spare = JList(cell, range(self.num_groups - 1, -1, -1))

    def _cached_pages(self) -> int:
        """Pages of cached groups: whole ones (WHOLE), else what each kept (BYTES: a cached
        group holding a partial page of blocks keeps the pages its fill needed)."""
        if self._whole:
            return len(self._cache) * self.pages_per_group
        return sum(self.table.pages_of(g) for g in self._cache)

    def _tokens(self, pages: int) -> int:
        """Whole tokens ``pages`` pool pages hold (spread over every member)."""
        geo = self.geometry
        return pages * self.page_bytes // (geo.token_bytes * geo.num_members)

    # -- room, in pool pages --
    @property
    def bound_pages(self) -> int:
        """Pool pages bound to some group's kind (not free, not adapters')."""
        return self.ledger.in_service_pages - self.ledger.free_pages - self._kv_adapter_pages

    @property
    def free_pages(self) -> int:
        """Pool pages bound to no group."""
        return self.ledger.free_pages

    def _available_units(self) -> int:
        """Pages an allocation may take: unbound, those of groups nobody holds and those of
        idle adapters (adapters.py)."""
        return (self.ledger.free_pages + len(self._free) * self.pages_per_group + self._cached_pages()
                + self._idle + self._kv_idle_adapter_pages)

    @property
    def available_member_pages(self) -> int:
        """Slices (one page of each member) an allocation may take."""
        return self._available_units() // self.geometry.num_members

    def _units_as_tokens(self, pages: int) -> int:
        return self.geometry.tokens_in_member_pages(pages // self.geometry.num_members)

    def _need(self, num_tokens: int, hits: list) -> int:
        revived = sum(1 for g in hits if self._refs[g] == 0)
        geo = self.geometry
        return geo.num_members * geo.slot_member_pages(num_tokens) - \
            (len(hits) - revived) * self.pages_per_group

    def _growth(self, seq: HeldSeq, num_tokens: int) -> int:
        """Pages ``append`` takes: the sequence's new bytes, plus a copy of a shared partial
        last group (copy-on-write)."""
        n, geo = seq.num_tokens, self.geometry
        need = geo.num_members * (geo.slot_member_pages(n + num_tokens) - geo.slot_member_pages(n))
        if n % self.tokens_per_page and num_tokens and self._refs[seq.units[-1]] > 1:
            need += self.table.pages_of(seq.units[-1])
        return need

    def _room_tokens(self, units: list) -> int:
        """Tokens the backed pages of a unit list hold (its last group's backed bytes)."""
        if self._whole:
            return len(units) * self.tokens_per_page
        backed = self.table.backed(0, units[-1])
        return (len(units) - 1) * self.tokens_per_page + \
            self.geometry.tokens_in_member_pages(backed)

    @property
    def reclaimable_tokens(self) -> int:
        """Capacity held only by unused groups (refs 0: still mapped, or cached): counted in
        ``stats().allocated_tokens`` but available to ``can_allocate``."""
        return self._tokens(self._idle + self._cached_pages())

    def kv_cache_usage(self) -> float:
        """vLLM's kv_cache_usage_perc (a fraction): pages bound to used groups, plus pinned
        adapters' pages in a shared pool, over the pool (free, cached and still-mapped unused
        groups and idle adapters count as free: KV takes them when it needs them)."""
        unused = len(self._free) * self.pages_per_group + self._cached_pages() + self._idle
        pinned_adapter_pages = self._kv_adapter_pages - self._kv_idle_adapter_pages
        return (self.bound_pages - unused + pinned_adapter_pages) / max(self.capacity_pages, 1)

    def stats(self) -> MemoryStats:
        """Tokens as the pages hold them (bytes = tokens * bytes_per_token, rounded down):
        ``total_tokens`` is the pool; ``free_tokens`` WHOLE: unbound pages and free groups,
        BYTES: unbound pages (adapters' pages count as allocated); ``live_tokens`` counts a
        partial group's tokens in the kinds that keep them; ``end_waste_tokens`` WHOLE: held
        groups' room past their tokens, BYTES: held pages' room past the live tokens."""
        tokens, ppg = self._tokens, self.pages_per_group
        total = tokens(self.capacity_pages)
        gone = len(self._partial) * self.tokens_per_page * self._win_pages
        live = (self._live * ppg - gone) // ppg
        if self._whole:
            free = tokens(self.ledger.free_pages + len(self._free) * ppg)
            allocated, waste = total - free, self._cap_sum - self._tok_sum
        else:
            allocated = tokens(self.bound_pages + self._kv_adapter_pages)
            free = total - allocated
            waste = max(tokens(self.bound_pages - self._idle - self._cached_pages()) - live, 0)
        return MemoryStats(total_tokens=total, allocated_tokens=allocated, live_tokens=live,
                           free_tokens=free, end_waste_tokens=waste,
                           bytes_per_token=self.bytes_per_token)

    def _units_text(self, pages: int) -> str:
        if self._whole and pages % self.pages_per_group == 0:
            return f"{pages // self.pages_per_group} page groups ({pages} pages)"
        return f"{pages} pages"

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(
            f"{what}: {self.ledger.free_pages} of {self.capacity_pages} pages unbound (a group takes "
            f"{self.pages_per_group}), {len(self._free)} free + {len(self._reclaimable)} "
            f"reclaimable + {len(self._cache)} cached page groups, "
            f"{self._kv_idle_adapter_pages} pages of idle adapters, "
            f"{len(self.slots.free)} free slots")

    # -- ops: a group's kinds' pool pages, named (the only places that emit them) --
    def _kinds_at(self, slot: int, pi: int):
        """Indexes of the kinds mapped where a group is mapped at (slot, pi)."""
        return self._kept if pi < self._win_gone[slot] else range(len(self.kinds))

    def _emit_map(self, slot: int, pi: int, g: int, kinds=None) -> None:
        """MapExtent of ``g``'s pages of ``kinds`` (indexes; None: all) at (slot, pi)."""
        owner = self.slots.owner[slot]
        for k in range(len(self.kinds)) if kinds is None else kinds:
            if self.table.extent(k, g):
                self._ops.append(MapExtent(slot, pi, self.kinds[k].name, self.table.extent(k, g),
                                           owner=owner))

    def _emit_unmap(self, slot: int, pi: int, g: int, kinds=None) -> None:
        """UnmapExtent of ``kinds`` at (slot, pi) (None: the kinds mapped there)."""
        for k in self._kinds_at(slot, pi) if kinds is None else kinds:
            if self.table.extent(k, g):
                self._ops.append(UnmapExtent(slot, pi, self.kinds[k].name))

    # -- the backing rule --
    def _append_other(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        """By BYTES (``_plain_append`` is False): an append within the last group's backed
        pages is any append; past them the slow path backs the new bytes."""
        if seq.units and seq.num_tokens + num_tokens <= self._room_tokens(seq.units):
            self._append_logged(seq_id, seq, num_tokens, token_ids)
            return
        self._cell.record(seq)     # (not _append_logged: its hot path would not back)
        self._append_slow(seq_id, seq, num_tokens, token_ids)

    def _back(self, g: int, k: int, pages: int, owner: Optional[int] = None) -> None:
        """Back kind ``k`` of ``g`` by ``pages`` pages of each member, mapped or unmapped
        wherever ``g`` is mapped with that kind (MapExtents serve ``owner``), reclaiming
        unheld groups first when too few pages are unbound (room was checked)."""
        table, old = self.table, self.table.backed(k, g)
        if pages == old:
            return
        name, spots = self.kinds[k].name, [(s, pi) for s, pi in sorted(self.slots.maps[g])
                                           if k in self._kinds_at(s, pi)]
        if pages > old:
            while (pages - old) * table.members[k] > self.ledger.free_pages:
                self._free_pages_for_kv()
            new = table.resize(k, g, pages)
            self._ops.extend(MapExtent(s, pi, name, new, old, owner=owner) for s, pi in spots)
        else:
            self._ops.extend(UnmapExtent(s, pi, name, pages) for s, pi in spots)
            table.resize(k, g, pages)

    def _back_all(self, g: int, pages: int) -> None:
        for k in range(len(self.kinds)):
            self._back(g, k, pages)

    def _fit(self, groups: Iterable[int], owner: int) -> None:
        """BYTES: back ``groups`` held by ``owner`` as their fill needs, shrinking first."""
        if self._whole:
            return
        want = [(g, self.geometry.member_pages_for(self._fill[g])) for g in groups
                if g is not None]
        for g, pages in want:
            for k in range(len(self.kinds)):
                if pages < self.table.backed(k, g):
                    self._back(g, k, pages, owner)
        for g, pages in want:
            for k in range(len(self.kinds)):
                if pages > self.table.backed(k, g):
                    self._back(g, k, pages, owner)

    def _free_pages_for_kv(self) -> None:
        """Free more ledger pages for KV (room was counted): an unheld group's, else an idle
        adapter's (the last resort before an allocation would fail)."""
        if self._reclaimable or self._cache:
            self._to_spare(self._reclaim())   # unbinds its pages
        elif not self._evict_adapter_for_kv():
            raise AssertionError("no pages left to free: room was miscounted")   # a bug

    def _reclaim(self) -> int:
        """The least recently used reclaimable group, else an evicted cached one, unmapped."""
        g = self._pop_reclaimable() if self._reclaimable else self._evict()
        self._unmap_everywhere(g)
        return g

    def _unmap_everywhere(self, g: int) -> None:
        for slot, pi in sorted(self.slots.maps[g]):
            self._emit_unmap(slot, pi, g)
            self.slots.take(slot, pi)

    def _to_free(self, g: int) -> None:
        """``g`` (refs 0, mapped nowhere, no content) is free: WHOLE keeps its pages."""
        if self._whole:
            self._free.append(g)
        else:
            self._to_spare(g)

    def _to_spare(self, g: int) -> None:
        self._back_all(g, 0)          # mapped nowhere: no op
        self._spare.append(g)

    def _enter_reclaimable(self, g: int) -> None:
        self._reclaimable.add(g)
        self._idle += self.table.pages_of(g)

    def _leave_reclaimable(self, g: int) -> None:
        self._reclaimable.remove(g)
        self._idle -= self.table.pages_of(g)

    def _pop_reclaimable(self) -> int:
        g = self._reclaimable.pop_first()
        self._idle -= self.table.pages_of(g)
        return g

    def _take_group(self) -> int:
        """A group for new content: a free one (WHOLE: it has pages), else a spare id (WHOLE:
        binding a page of every member; BYTES: none yet), else the least recently used
        reclaimable one, else the cached one the eviction policy names, unmapped everywhere,
        else a spare id bound to pages idle adapters gave back."""
        need = self.pages_per_group if self._whole else 0
        if self._free:
            g = self._free.pop()
        elif self._spare and (self.ledger.free_pages >= need or not (
                self._reclaimable or self._cache)):
            while self.ledger.free_pages < need:   # what is left is idle adapters' pages
                self._free_pages_for_kv()
            g = self._spare.pop()
            if self._whole:
                self._back_all(g, self.geometry.pages_per_member)
        else:
            g = self._reclaim()
        self._touch(g)
        self._refs[g], self._fill[g] = 1, 0
        return g

    def _unheld(self, g: int) -> None:
        self._forget_blocks(g)        # not retained: its content goes, blocks included
        if g in self._partial:        # mapped nowhere: its last full-only mapping went
            self._partial.remove(g)
            self._to_spare(g)
        elif self.slots.maps[g]:
            self._enter_reclaimable(g)     # still mapped where it was used
        else:
            self._to_free(g)

    def _drop_findable(self, g: int) -> None:
        """g's content forgotten (registration, blocks); the cached groups chained below it
        can no longer be reached: given back (``_evict``, ``unpublish``)."""
        drop_cached_chain(self.prefix, g, self._refs, self._cache, self._unheld, self.blocks)
        self._forget_blocks(g)

    def _revive(self, g: int) -> None:
        if g in self._reclaimable:
            self._leave_reclaimable(g)
        else:
            self._cache.remove(g)

    # -- the release rule --
    def _unhold(self, g: int) -> None:
        if self._refs[g] == 1 and self.blocks is not None:   # cached next: reachable blocks only
            self.blocks.drop_orphaned(g, self.prefix.by_digest)
        super()._unhold(g)
        if self._win and self._refs[g] and g not in self._partial and \
                self._win_drop[g] == self._refs[g]:
            self._release_window(g)   # the holder that still read its window went

    def _window_dropped(self, seq: HeldSeq) -> int:
        return self._win_gone[seq.slot] if self._win else dropped_units(seq)

    def _shareable(self, unit: Optional[int]) -> bool:
        return unit is not None and unit not in self._partial

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """Unmap the windowed kinds of the sequence's pages wholly before ``computed_tokens -
        W + 1`` (the last page always stays whole); release them where no holder needs them
        any more. A model whose every layer has the window gives back whole groups."""
        if not self._win:
            UnitOps.release_behind_window(self, seq_id, computed_tokens)
            return
        seq = self._changing(seq_id)
        first_read = computed_tokens - self._window + 1
        behind = min(max(first_read, 0) // self.tokens_per_page, len(seq.units) - 1)
        slot = seq.slot
        for pi in range(self._win_gone[slot], behind):
            g = seq.units[pi]
            self._emit_unmap(slot, pi, g, self._win)
            self._win_gone[slot] = pi + 1
            self._win_drop[g] += 1
            if self._win_drop[g] == self._refs[g]:
                self._release_window(g)

    def _release_window(self, g: int) -> None:
        """No holder reads g's windowed kinds: unmap its whole mappings (none is a holder's),
        give their pages back; no prompt reaches it, nor below it (``drop_cached_chain``)."""
        for slot, pi in sorted(self.slots.maps[g]):
            if pi >= self._win_gone[slot]:
                self._unmap(slot, pi)
        drop_cached_chain(self.prefix, g, self._refs, self._cache, self._unheld, self.blocks)
        self._cache.forget(g)
        self._partial.add(g)
        for k in self._win:
            self._back(g, k, 0)       # mapped nowhere with these kinds: no op

    def _share_page(self, slot: int, pi: int, g: int) -> None:
        """Map held group ``g`` at (slot, pi) unless it is mapped there already; behind the
        slot's frontier (a fork's page behind the window) without its windowed kinds."""
        pages = self.slots.pages[slot]
        if pi >= self._win_gone[slot]:
            if pages.get(pi) != g:
                if pi in pages:
                    self._unmap(slot, pi)
                self._map(slot, pi, g)
            return
        self._win_drop[g] += 1
        if pages.get(pi) == g:        # a whole deferred mapping of it: drop its windowed kinds
            self._emit_unmap(slot, pi, g, self._win)
            return
        if pi in pages:               # a whole deferred mapping of another group
            self._unmap(slot, pi, range(len(self.kinds)))
        self.slots.put(slot, pi, g)
        self._emit_map(slot, pi, g, self._kinds_at(slot, pi))

    def _unmap_behind(self, slot: int) -> None:
        """At release: mappings without their windowed kinds cannot stay for deferred
        reclamation (a later sequence on the slot would find members missing)."""
        for pi in range(self._win_gone[slot]):
            g = self.slots.take(slot, pi)
            self._emit_unmap(slot, pi, g)
            self._win_drop[g] -= 1
        self._win_gone[slot] = 0
