"""vmem manager (the vAttention approach): each sequence owns one slot (a batch row of
``max_seq_len`` tokens, contiguous in virtual memory) and physical page groups are mapped under
it on demand.

    slot s:  | page 0 | page 1 | page 2 | ... | page pages_per_slot-1 |
               tokens [pi*tpp, (pi+1)*tpp) live under page index pi
               each mapped page index is backed by one page GROUP g (2*L pages per-layer,
               2 pages interleaved); the same g may be mapped under several slots (fork,
               shared prefix) but always at the page index whose content it holds.

A group is in one of four states (reclaimable and cached ones count as ALLOCATED in stats and
AVAILABLE to admit):
    free         refs 0, mapped nowhere, no content kept           in ``_free``
    reclaimable  refs 0, still mapped (freed slot, or past a live   in ``_reclaimable`` (LRU)
                 sequence's length), no content kept
    cached       refs 0, registered (full, computed), mapped or not in ``_cache`` (the policy)
    used         refs >= 1 (live sequences using it)

Deferred reclamation: ``free`` unmaps nothing; a later sequence placed on the slot writes into
the pages still mapped there without any op, and groups are unmapped (UnmapExtent) only when the
free list is empty and a group must be taken from a reclaimable one, then from the cache. Only
refs-0 groups are ever reclaimed, so no live sequence loses a page it reads. Retention
(units.py): a hit maps the cached group itself at its page index under the new slot (no copy);
a sequence whose first hit is still mapped under a free slot is placed on that slot.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError, OutOfCapacityError, RequestTooLargeError, SlotError
from ..geometry import LAYOUTS, PageGeometry  # noqa: F401 (LAYOUTS re-exported)
from ..layout import CacheKind, CacheLayout, PoolBacking, whole_kind_name
from ..presets import ModelSpec
from .base import CopyExtent, MapExtent, MemoryStats, UnmapExtent
from .common import check_int
from .eviction import DEFAULT_EVICTION
from .journal import JDict, JList, JSet, OrderedUnits
from .kinds import KindSpec
from .ledger import PageLedger
from .prefix import HeldSeq
from .slots import FreeSlots
from .units import UnitManager
from .vmem_integrity import VmemIntegrity
from .window import WindowedGroups, dropped_units, held_units


class VmemManager(VmemIntegrity, WindowedGroups, UnitManager):
    """Slot + page-group manager. ``prefix_queries``/``prefix_hits`` count TOKENS. With a
    model whose every layer is windowed it gives back groups behind the window (window.py)."""

    name = "vmem"

    def __init__(self, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 page_bytes: int = 2 * 2**20, layout: str = "per-layer",
                 max_slots: Optional[int] = None, swap_bytes: int = 0,
                 prefix_eviction: str = DEFAULT_EVICTION) -> None:
        super().__init__(model, max_seq_len_tokens, swap_bytes)
        check_int("page_bytes", page_bytes, 1)
        self.geometry = PageGeometry.of(model, page_bytes, layout)
        self.page_bytes = page_bytes
        self.tokens_per_page = self.geometry.tokens_per_page
        self.pages_per_group = self.geometry.pages_per_group
        tpp = self.tokens_per_page
        if self.max_seq_len % tpp:
            low, high = self.max_seq_len // tpp * tpp, -(-self.max_seq_len // tpp) * tpp
            near = f"{low} or {high}" if low else f"{high}"
            raise ConfigError(f"max_seq_len_tokens={self.max_seq_len} is not a multiple of "
                              f"tokens_per_page={tpp} ({layout}, page_bytes={page_bytes}); "
                              f"nearest valid: {near}")
        unit, unit_pages = self._smallest_unit()
        whole_groups = check_int("cache_bytes", cache_bytes, 1) // (page_bytes * unit_pages)
        if whole_groups < 1:
            raise ConfigError(f"cache_bytes={cache_bytes} holds no {unit} of {page_bytes * unit_pages}"
                              f" bytes; needs >= {page_bytes * unit_pages}")
        self.num_groups, self.pool_pages = self._pool(cache_bytes, whole_groups)
        # Every running sequence holds >= 1 whole group (vmem_bytes.py: slice), so more slots
        # could never all be used at once; virtual address space is cheap: exactly that many.
        self.num_slots = check_int("max_slots", whole_groups if max_slots is None else max_slots, 1)
        self.pages_per_slot = self.max_seq_len // tpp
        self._init_units(self.num_groups, tpp, prefix_eviction)
        cell = self._cell    # every container below logs to an open transaction's journal
        self._reclaimable = OrderedUnits(cell)   # refs 0, mapped, no content: LRU first
        self._maps = tuple(JSet(cell) for _ in range(self.num_groups))   # group -> {(slot, pi)}
        self._pages = tuple(JDict(cell) for _ in range(self.num_slots))  # slot -> {pi: group}
        self._owner = JList(cell, [None] * self.num_slots)      # slot -> seq_id or None
        self._free_slots = FreeSlots(self.num_slots, self.pages_per_slot, cell)
        self._init_window(model.window_tokens)
        self.kinds = self._kinds(model)
        self.ledger = PageLedger(cell, self.pool_pages)        # the pool's pages, by kind
        self._extents = tuple(JList(cell, [()] * self.num_groups) for _ in self.kinds)
        self._back_fixed()

    def _kinds(self, model: ModelSpec) -> tuple:
        """The layer kinds whose members an op names: one here, every layer (hybrid.py: the
        full and the windowed layers)."""
        w = model.window_tokens
        return (KindSpec(whole_kind_name(w), tuple(range(model.num_layers)), w),)

    def _back_fixed(self) -> None:
        """Fixed groups: group g holds its pages_per_group pool pages for good (taken once
        from the ledger: g * pages_per_group ...); hybrid.py and vmem_bytes.py take on demand."""
        name = self.kinds[0].name
        for g in range(self.num_groups):
            self._extents[0][g] = self.ledger.take(self.pages_per_group, name)

    pool_backing = PoolBacking.FIXED   # how pool pages back groups: PARTS (hybrid.py), BYTES
                                       # (vmem_bytes.py: groups backed by their bytes)

    def layout(self) -> CacheLayout:
        """A vmem cache of this geometry, slots, groups and pool."""
        return CacheLayout(CacheKind.VMEM, self.pages_per_slot * self.tokens_per_page,
                           geometry=self.geometry, num_slots=self.num_slots,
                           pages_per_slot=self.pages_per_slot, num_groups=self.num_groups,
                           backing=self.pool_backing, pool_pages=self.pool_pages,
                           kinds=tuple((k.name, k.layers) for k in self.kinds))

    def _smallest_unit(self) -> tuple:
        """(name, pages) of the least a running sequence holds: a whole page group here."""
        return "page group", self.pages_per_group

    def _pool(self, cache_bytes: int, whole_groups: int) -> tuple:
        """(group ids, pool pages): one id per fixed set of pages (hybrid.py: more ids)."""
        return whole_groups, whole_groups * self.pages_per_group

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self.num_groups * self.tokens_per_page)

    @property
    def pages_per_map_op(self) -> int:
        return self.pages_per_group

    _FIXED_FIELDS = UnitManager._FIXED_FIELDS | {
        "geometry", "page_bytes", "tokens_per_page", "pages_per_group", "num_groups", "num_slots",
        "pages_per_slot", "_window", "kinds", "pool_pages"}
    _JOURNALED_FIELDS = UnitManager._JOURNALED_FIELDS | {
        "_reclaimable", "_maps", "_pages", "_owner", "_free_slots", "ledger", "_extents"}

    # -- queries the runtime needs --
    def slot_of(self, seq_id: int) -> int:
        return self._seq(seq_id).slot

    def mapped_pages(self, slot: int) -> dict:
        """{page_index: group} currently mapped under ``slot`` (live or deferred)."""
        return dict(self._pages[slot])

    def mapped_extents(self, slot: int) -> dict:
        """{page_index: {kind: pool pages}} mapped under ``slot``, as the ops named them (an
        executor's replica must equal it)."""
        out = {}
        for pi, g in self._pages[slot].items():
            kinds = {self.kinds[k].name: self._extents[k][g] for k in self._kinds_at(slot, pi)
                     if self._extents[k][g]}
            if kinds:
                out[pi] = kinds
        return out

    def _kinds_at(self, slot: int, pi: int) -> range:
        """Indexes of the kinds mapped where a group is mapped at (slot, pi): all of them."""
        return range(len(self.kinds))

    def full_only_pages(self, slot: int) -> int:
        """Leading mapped pages of ``slot`` with only their FULL part mapped (hybrid.py: the
        window behind; 0 here, every mapped page is whole)."""
        return 0

    @property
    def reclaimable_tokens(self) -> int:
        """Capacity held only by unused groups (refs 0: still mapped, or cached): counted in
        ``stats().allocated_tokens`` but available to ``can_allocate``."""
        return (len(self._reclaimable) + len(self._cache)) * self.tokens_per_page

    def kv_cache_usage(self) -> float:
        """vLLM's kv_cache_usage_perc (a fraction): cached and still-mapped unused groups count
        as free, as vLLM counts its cached blocks."""
        unused = len(self._free) + len(self._reclaimable) + len(self._cache)
        return (self.num_groups - unused) / self.num_groups

    # -- ops: the pool pages of a group's kinds, named (the only places that emit them) --
    def _emit_map(self, slot: int, pi: int, g: int, kinds=None) -> None:
        """MapExtent of ``g``'s pages of ``kinds`` (indexes; None: all) at (slot, pi)."""
        owner = self._owner[slot]
        for k in range(len(self.kinds)) if kinds is None else kinds:
            if self._extents[k][g]:
                self._ops.append(MapExtent(slot, pi, self.kinds[k].name, self._extents[k][g],
                                           owner=owner))

    def _emit_unmap(self, slot: int, pi: int, g: int, kinds=None) -> None:
        """UnmapExtent of ``kinds`` at (slot, pi) (None: the kinds mapped there)."""
        for k in self._kinds_at(slot, pi) if kinds is None else kinds:
            if self._extents[k][g]:
                self._ops.append(UnmapExtent(slot, pi, self.kinds[k].name))

    # -- mapping primitives --
    def _map(self, slot: int, pi: int, g: int) -> None:
        self._pages[slot][pi] = g
        self._maps[g].add((slot, pi))
        self._emit_map(slot, pi, g)

    def _unmap(self, slot: int, pi: int, kinds=None) -> None:
        pages = self._pages[slot]
        g = pages[pi]
        self._emit_unmap(slot, pi, g, kinds)
        del pages[pi]
        self._maps[g].discard((slot, pi))
        self._free_slots.recount(slot, len(pages))
        if g in self._reclaimable and not self._maps[g]:
            self._reclaimable.remove(g)
            self._free.append(g)          # (a cached group stays cached, mapped nowhere)

    def _take_group(self) -> int:
        """A group for new content: a free one, else the least recently used reclaimable one,
        else the cached one the eviction policy names; unmapped everywhere it is still mapped."""
        if self._free:
            g = self._free.pop()
        else:
            if self._reclaimable:
                g = self._reclaimable.pop_first()
            else:
                g = self._evict()
            self._unmap_everywhere(g)
        self._touch(g)
        self._refs[g], self._fill[g] = 1, 0
        return g

    def _unmap_everywhere(self, g: int) -> None:
        for slot, pi in sorted(self._maps[g]):
            self._emit_unmap(slot, pi, g)
            del self._pages[slot][pi]
            self._free_slots.recount(slot, len(self._pages[slot]))
        self._maps[g].clear()

    def _unheld(self, g: int) -> None:
        if self._maps[g]:
            self._reclaimable.add(g)       # still mapped where it was used
            return
        self._free.append(g)

    def _revive(self, g: int) -> None:
        if g in self._reclaimable:
            self._reclaimable.remove(g)
        else:
            self._cache.remove(g)

    def _give_back(self, seq: HeldSeq, pi: int, g: int) -> None:
        if self._pages[seq.slot].get(pi) == g:     # a window's group: unmapped at once
            self._unmap(seq.slot, pi)

    def _grow_page(self, slot: int, pi: int) -> int:
        """Back page ``pi`` of ``slot`` with a private group for new content: the group
        already mapped there if nobody uses it and it holds nothing cached (no op), else a
        fresh one (a cached group stays cached for later hits)."""
        g = self._pages[slot].get(pi)
        if g is not None and g in self._reclaimable:
            self._reclaimable.remove(g)
            self._touch(g)
            self._refs[g], self._fill[g] = 1, 0
            return g
        if g is not None:
            self._unmap(slot, pi)          # used elsewhere, or cached: not ours to write
        g = self._take_group()
        self._map(slot, pi, g)
        return g

    def _available_units(self) -> int:
        return len(self._free) + len(self._reclaimable) + len(self._cache)

    # -- placement --
    def _occupy(self, seq_id: int, seq: HeldSeq, slot: Optional[int] = None) -> int:
        slot = self._free_slots.pick() if slot is None else slot
        self._free_slots.remove(slot)
        self._owner[slot] = seq_id
        seq.slot = slot
        return slot

    def _hit_slot(self, hits: list) -> Optional[int]:
        """A free slot where the first hit is still mapped at page 0 (the lowest), else None."""
        if not hits:
            return None
        slots = [s for s, pi in self._maps[hits[0]] if pi == 0 and s in self._free_slots]
        return min(slots) if slots else None

    def _place(self, seq_id: int, seq: HeldSeq, hits: list, slot: Optional[int] = None) -> None:
        """Put ``seq`` on ``slot``, by default a free slot already mapping its hits, else the
        free slot with the most mapped pages: shared ``hits`` first (they hold refs before any
        reclaim can run), then private pages."""
        slot = self._occupy(seq_id, seq, self._hit_slot(hits) if slot is None else slot)
        self._share_into(slot, hits)
        n, tpp = seq.num_tokens, self.tokens_per_page
        seq.units = list(hits) + [self._grow_page(slot, pi)
                                  for pi in range(len(hits), -(-n // tpp))]
        for pi in range(len(hits), len(seq.units)):
            self._touch(seq.units[pi])
            self._fill[seq.units[pi]] = min(tpp, n - pi * tpp)
        self._live += n - len(hits) * tpp
        self._cap_sum += len(seq.units) * tpp
        self._tok_sum += n
        self._put_seq(seq_id, seq)

    def _share_into(self, slot: int, groups: list) -> None:
        """Hold ``groups`` (page index -> group) and map each under ``slot`` where it is not
        mapped already (the same physical pages at a second address: no copy)."""
        for pi, g in enumerate(groups):
            if g is not None:         # None: behind a window, given back
                self._hold(g)
                self._share_page(slot, pi, g)

    def _share_page(self, slot: int, pi: int, g: int) -> None:
        """Map held group ``g`` at (slot, pi) unless it is mapped there already."""
        pages = self._pages[slot]
        if pages.get(pi) != g:
            if pi in pages:
                self._unmap(slot, pi)
            self._map(slot, pi, g)

    def _can_place(self) -> bool:
        return bool(self._free_slots)

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None,
                 slot: Optional[int] = None) -> int:
        """As :meth:`MemoryManager.allocate`; ``slot`` places the sequence on that free slot
        (e.g. batch row b on slot b) instead of the one with the most pages still mapped."""
        self._check_new(seq_id)
        self._check_length(num_tokens)
        if slot is not None:
            self._check_slot_free(seq_id, slot)
        elif not self._free_slots:
            raise OutOfCapacityError(f"sequence {seq_id}: all {self.num_slots} slots are in use")
        hits = self._hits(num_tokens, token_ids, namespace)
        need = self._need(num_tokens, hits)
        if need > self._available_units():
            self._raise_no_room(f"sequence {seq_id} needs {need} page groups")
        seq = self._new_seq(num_tokens, token_ids, namespace)
        self._place(seq_id, seq, hits, slot)
        self._register_prompt(seq, hits)
        return self._count_prefix(token_ids, num_tokens, hits)

    def _check_slot_free(self, seq_id: int, slot) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise SlotError(f"sequence {seq_id}: slot {slot!r} is outside this manager's slots "
                            f"0..{self.num_slots - 1}")
        if slot not in self._free_slots:
            raise SlotError(f"sequence {seq_id}: slot {slot} holds sequence {self._owner[slot]}")

    # -- growth --
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        new = seq.num_tokens + num_tokens
        if seq.units and new <= len(seq.units) * self.tokens_per_page and self._refs[seq.units[-1]] == 1:
            return True      # hot path: room in a private last page
        return new <= self.max_seq_len and self._growth(seq, num_tokens) <= self._available_units()

    def _append_slow(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        self._check_append_ids(num_tokens, token_ids)
        old, tpp, slot = seq.num_tokens, self.tokens_per_page, seq.slot
        if old + num_tokens > self.max_seq_len:
            raise RequestTooLargeError(f"sequence {seq_id} would grow to {old + num_tokens} "
                                       f"tokens, over max_seq_len {self.max_seq_len}")
        need = self._growth(seq, num_tokens)
        if need > self._available_units():
            self._raise_no_room(f"appending {num_tokens} tokens to sequence {seq_id} needs "
                                f"{need} page groups")
        if num_tokens == 0:
            return
        if old % tpp and self._refs[seq.units[-1]] > 1:
            self._copy_on_write(seq, len(seq.units) - 1)
        before = len(seq.units)
        for pi in range(before, -(-(old + num_tokens) // tpp)):
            seq.units.append(self._grow_page(slot, pi))
        self._cap_sum += (len(seq.units) - before) * tpp
        pos, end = old, old + num_tokens
        while pos < end:
            pi = pos // tpp
            stop = min(end, (pi + 1) * tpp)
            self._touch(seq.units[pi])
            self._fill[seq.units[pi]] += stop - pos
            pos = stop
        self._live += num_tokens
        self._tok_sum += num_tokens
        seq.num_tokens = end
        seq.note_ids(old, token_ids)
        if end // tpp > old // tpp:
            seq.new_full_keys(tpp, self.model.kv_encoding)

    def _copy_on_write(self, seq: HeldSeq, pi: int) -> None:
        """The writer of a shared partial page moves to a new group holding a copy."""
        slot, old = seq.slot, seq.units[pi]
        new = self._take_group()                  # old has refs >= 2: never reclaimed here
        self._unhold(old)
        self._unmap(slot, pi)
        self._map(slot, pi, new)
        self._copy_backing(new, old, self._owner[slot])
        src_slot, src_pi = min(self._maps[old])   # same physical group wherever it is mapped
        for k, kind in enumerate(self.kinds):
            if self._extents[k][old]:
                self._ops.append(CopyExtent(src_slot, src_pi, slot, pi, kind.name,
                                            owner=self._owner[slot]))
        self._touch(new)
        self._fill[new] = self._fill[old]
        self._live += self._fill[old]
        seq.units[pi] = new

    def _copy_backing(self, dst: int, src: int, owner: Optional[int]) -> None:
        """Before CopyExtent: back ``dst`` as far as ``src`` (vmem_bytes.py); fixed groups are."""

    # -- fork and release --
    def can_fork(self, parent_id: int) -> bool:
        self._seq(parent_id)
        return len(self._free_slots) > 0

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        self._check_new(child_id)
        if not self._free_slots:
            self._raise_no_room(f"forking sequence {parent_id}: all {self.num_slots} slots in use")
        child = parent.copy()
        self._share_into(self._occupy(child_id, child), child.units)
        self._cap_sum += len(held_units(child)) * self.tokens_per_page
        self._tok_sum += child.num_tokens - dropped_units(child) * self.tokens_per_page
        self._put_seq(child_id, child)

    def _swap_location(self, seq: HeldSeq) -> dict:
        return {"slot": seq.slot}

    def _release(self, seq: HeldSeq) -> None:
        held = held_units(seq)
        for g in reversed(held):        # tail pages enter the LRU first: reclaimed first
            self._unhold(g)
        self._cap_sum -= len(held) * self.tokens_per_page
        self._tok_sum -= seq.num_tokens - (len(seq.units) - len(held)) * self.tokens_per_page
        self._owner[seq.slot] = None
        self._free_slots.add(seq.slot, len(self._pages[seq.slot]))
        seq.units, seq.slot = [], -1

    # -- swap hooks --
    def _fresh_units(self, seq: HeldSeq) -> Optional[int]:
        if not self._free_slots:
            return None
        return -(-seq.num_tokens // self.tokens_per_page)

    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        self._place(seq_id, seq, [])
        self._republish(seq)

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(f"{what}: {len(self._free)} free + {len(self._reclaimable)} "
                                 f"reclaimable + {len(self._cache)} cached page groups, "
                                 f"{len(self._free_slots)} free slots")

    # -- queries --
    def stats(self) -> MemoryStats:
        free = len(self._free) * self.tokens_per_page
        total = self.num_groups * self.tokens_per_page
        return MemoryStats(total_tokens=total, allocated_tokens=total - free,
                           live_tokens=self._live, free_tokens=free,
                           end_waste_tokens=self._cap_sum - self._tok_sum,
                           bytes_per_token=self.bytes_per_token)
