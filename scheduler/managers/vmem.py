"""vmem manager (the vAttention approach): each sequence owns one slot (a batch row of
``max_seq_len`` tokens, contiguous in virtual memory) and physical pages are mapped under it on
demand.

    slot s:  | page 0 | page 1 | page 2 | ... | page pages_per_slot-1 |
               tokens [pi*tpp, (pi+1)*tpp) live under page index pi, backed by one page GROUP
               g; the same g may be mapped under several slots (fork, shared prefix) but
               always at the page index whose content it holds.

A group is a set of per-kind EXTENTS (``KindTable``, kinds.py): for each layer kind the pool
pages backing its members, from one PageLedger; how they are backed and which kinds go back
behind the window are values (vmem_kinds.py). Where groups are mapped: ``slots`` (slots.py).
A group is
    spare        no pages, mapped nowhere, refs 0                 in ``_spare``
    free         refs 0, mapped nowhere, pages kept (WHOLE)       in ``_free``
    reclaimable  refs 0, still mapped (freed slot, or past a live   in ``_reclaimable`` (LRU)
                 sequence's length), no content kept
    cached       refs 0, registered (full, computed), mapped or not in ``_cache`` (the policy)
    used         refs >= 1 (live sequences); partial: its windowed kinds released
Reclaimable and cached groups count as ALLOCATED in stats and AVAILABLE to admit.

Block-granular hits (blocks.py, ``prefix_block_tokens``, 16 by default) are copied. Deferred
reclamation: ``free`` unmaps nothing; a later sequence placed on the slot writes into
the pages still mapped there without any op, and groups are unmapped (UnmapExtent) only when a
group must be taken from a reclaimable one, then from the cache. Only refs-0 groups are ever
reclaimed, so no live sequence loses a page it reads. Retention (units.py): a hit maps the
cached group itself at its page index under the new slot (no copy); a sequence whose first hit
is still mapped under a free slot is placed on that slot. Room is counted in pool pages.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import OutOfCapacityError
from ..geometry import LAYOUTS, PageGeometry  # noqa: F401 (LAYOUTS re-exported)
from ..layout import CacheKind, CacheLayout, PoolBacking
from ..presets import ModelSpec
from .base import CopyExtent
from .blocks import BlockIndex, block_hit, copy_tokens, reached_groups
from .adapters import AdapterTenancy
from .common import ManagerCore, check_int
from .integrity import check_vmem, idle_vmem
from .elastic import ElasticPool
from .eviction import DEFAULT_EVICTION
from .journal import OrderedUnits
from .kinds import KindTable, VmemShape
from .prefix import HeldSeq, namespace_root
from .slots import SlotMap
from .units import UnitOps
from .vmem_kinds import KindRules
from .window import dropped_units, held_units


class VmemManager(ElasticPool, KindRules, AdapterTenancy, UnitOps, ManagerCore):
    """Slot + page-group manager over per-kind extents. ``prefix_queries``/``prefix_hits``
    count TOKENS. ``hybrid_parts`` (a hybrid model in the per-layer layout): one kind per
    attention pattern, the windowed one given back behind the window; else one kind of every
    layer. Guarantees: pages bound <= ``pool_pages``; a held group is backed as its rule says
    (WHOLE: every member page; BYTES: exactly what its tokens need)."""

    name = "vmem"

    def __init__(self, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 page_bytes: int = 2 * 2**20, layout: str = "per-layer",
                 max_slots: Optional[int] = None, swap_bytes: int = 0,
                 prefix_eviction: str = DEFAULT_EVICTION, hybrid_parts: bool = False,
                 prefix_block_tokens: int = 16, max_cache_bytes: Optional[int] = None,
                 adapter_budget_bytes: Optional[int] = None) -> None:
        """``max_cache_bytes`` (default ``cache_bytes``): the most ``resize`` may grow the pool
        to; its page ids, groups and slots exist from the start, the pages past ``cache_bytes``
        released (held by the device: no memory behind them). ``adapter_budget_bytes``
        (None: LoRA adapters share the pool's pages with KV): a static split, adapters in
        pages of their own of that many bytes, KV in the rest of ``cache_bytes`` (adapters.py;
        such a pool does not resize)."""
        super().__init__(model, max_seq_len_tokens, swap_bytes)
        check_int("page_bytes", page_bytes, 1)
        check_int("cache_bytes", cache_bytes, 1)
        self.adapter_budget_bytes = adapter_budget_bytes
        geo = self.geometry = PageGeometry.of(model, page_bytes, layout)
        self.page_bytes = page_bytes
        self.tokens_per_page = tpp = geo.tokens_per_page
        self.pages_per_group = geo.pages_per_group
        self.backing = PoolBacking.WHOLE if geo.exact else PoolBacking.BYTES
        shape = VmemShape.of(model, geo, cache_bytes, max_cache_bytes, max_slots,
                             self.max_seq_len, hybrid_parts, adapter_budget_bytes)
        self.kinds, self._win = shape.kinds, shape.windowed   # (kinds given back: windowed)
        self.pool_pages, self.num_groups = shape.pool_pages, shape.num_groups
        self.num_slots, self.pages_per_slot = shape.num_slots, shape.pages_per_slot
        self._init_units(self.num_groups, tpp, prefix_eviction)
        cell = self._cell    # every container below logs to an open transaction's journal
        self._reclaimable = OrderedUnits(cell)   # refs 0, mapped, no content: LRU first
        self.slots = SlotMap(self.num_slots, self.num_groups, self.pages_per_slot, cell)
        self._init_window(model.local_window_tokens if self._win else model.window_tokens)
        self.table = KindTable(cell, self.kinds, geo.per_layer, self.num_groups, self.pool_pages,
                               shape.service_pages)
        self.ledger = self.table.ledger        # the pool's pages, by kind
        self._released_at_start = self.ledger.released_pages
        self._init_rules(cell)
        # blocks finer than a page, where a page holds several (not with windows: a window
        # gives pages back, and only whole groups are shared behind one)
        bt = check_int("prefix_block_tokens", prefix_block_tokens, 0)
        self.block_tokens = bt if bt and tpp > bt and not tpp % bt and self._window is None else 0
        self.blocks = BlockIndex(bt, cell) if self.block_tokens else None
        self.prefix_unit_tokens = self.block_tokens or tpp   # publish on compute at this stride
        self.block_hit_tokens = 0              # prompt tokens served by block copies
        self._init_adapters(self.ledger, page_bytes, shape.adapter_pages, self.pool_pages,
                            "pool page")

    def layout(self) -> CacheLayout:
        """A vmem cache of this geometry, slots, groups and pool."""
        return CacheLayout(CacheKind.VMEM, self.pages_per_slot * self.tokens_per_page,
                           geometry=self.geometry, num_slots=self.num_slots,
                           pages_per_slot=self.pages_per_slot, num_groups=self.num_groups,
                           backing=self.backing, pool_pages=self.pool_pages,
                           released_pages=self._released_at_start,
                           kinds=tuple((k.name, k.layers) for k in self.kinds),
                           adapter_pool_pages=0 if self._adapters_share_kv
                           else self._adapter_ledger.num_pages)

    def copied_bytes(self, ops: list) -> int:
        """A ``CopyExtent`` moves ``num_tokens`` tokens of its kind's layers, or (copy-on-write)
        the source's ``member_pages`` of each member (byte-mapped: what its tokens need)."""
        total, layer_token_bytes = 0, 2 * self.model.layer_bytes_per_token
        for op in ops:
            if type(op) is CopyExtent:
                k = next(i for i, kind in enumerate(self.kinds) if kind.name == op.kind)
                if op.num_tokens is not None:
                    total += op.num_tokens * self.kinds[k].num_layers * layer_token_bytes
                else:
                    pages = op.member_pages or self.geometry.pages_per_member
                    total += pages * self.table.members[k] * self.page_bytes
        return total

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self._tokens_in_units(self.capacity_pages))

    def _tokens_in_units(self, pages: int) -> int:
        """Tokens of one sequence that ``pages`` pool pages hold (slices of every member)."""
        geo = self.geometry
        whole, rest = divmod(pages // geo.num_members, geo.pages_per_member)
        return whole * self.tokens_per_page + geo.tokens_in_member_pages(rest)

    def _kv_ledger(self):
        return self.ledger

    @property
    def pages_per_map_op(self) -> int:
        return self.pages_per_group

    _FIXED_FIELDS = UnitOps._FIXED_FIELDS | AdapterTenancy._ADAPTER_FIXED | {
        "geometry", "page_bytes", "tokens_per_page", "pages_per_group", "num_groups", "num_slots",
        "pages_per_slot", "_window", "kinds", "pool_pages", "backing", "_win", "_whole",
        "_plain_append", "_released_at_start", "_win_pages", "_kept", "block_tokens"}
    _SAVED_FIELDS = UnitOps._SAVED_FIELDS + AdapterTenancy._ADAPTER_SAVED + (
        "_idle", "block_hit_tokens")
    _JOURNALED_FIELDS = UnitOps._JOURNALED_FIELDS | AdapterTenancy._ADAPTER_JOURNALED | {
        "blocks", "_reclaimable", "slots", "ledger", "table",
        "_spare", "_partial", "_win_drop", "_win_gone"}

    # -- queries the runtime needs --
    def slot_of(self, seq_id: int) -> int:
        return self._seq(seq_id).slot

    def mapped_pages(self, slot: int) -> dict:
        """{page_index: group} currently mapped under ``slot`` (live or deferred)."""
        return dict(self.slots.pages[slot])

    def mapped_extents(self, slot: int) -> dict:
        """{page_index: {kind: pool pages}} mapped under ``slot``, as the ops named them (an
        executor's replica must equal it)."""
        out = {}
        for pi, g in self.slots.pages[slot].items():
            kinds = {self.kinds[k].name: self.table.extent(k, g) for k in self._kinds_at(slot, pi)
                     if self.table.extent(k, g)}
            if kinds:
                out[pi] = kinds
        return out

    # -- mapping primitives --
    def _map(self, slot: int, pi: int, g: int) -> None:
        self.slots.put(slot, pi, g)
        self._emit_map(slot, pi, g)

    def _unmap(self, slot: int, pi: int, kinds=None) -> None:
        g = self.slots.pages[slot][pi]
        self._emit_unmap(slot, pi, g, kinds)
        self.slots.take(slot, pi)
        if g in self._reclaimable and not self.slots.maps[g]:
            self._leave_reclaimable(g)
            self._to_free(g)          # (a cached group stays cached, mapped nowhere)

    def _give_back(self, seq: HeldSeq, pi: int, g: int) -> None:
        if self.slots.pages[seq.slot].get(pi) == g:     # a window's group: unmapped at once
            self._unmap(seq.slot, pi)

    def _grow_page(self, slot: int, pi: int) -> int:
        """Back page ``pi`` of ``slot`` with a private group for new content: the group
        already mapped there if nobody uses it and it holds nothing cached (no op), else a
        fresh one (a cached group stays cached for later hits)."""
        g = self.slots.pages[slot].get(pi)
        if g is not None and g in self._reclaimable:
            self._leave_reclaimable(g)
            self._touch(g)
            self._refs[g], self._fill[g] = 1, 0
            return g
        if g is not None:
            self._unmap(slot, pi)          # used elsewhere, or cached: not ours to write
        g = self._take_group()
        self._map(slot, pi, g)
        return g

    # -- placement --
    def _occupy(self, seq_id: int, seq: HeldSeq, slot: Optional[int] = None) -> int:
        # a fork's record still names its parent's slot: it inherits the parent's frontier
        gone = self._win_gone[seq.slot] if seq.slot >= 0 else 0
        seq.slot = slot = self.slots.occupy(seq_id, slot)
        self._win_gone[slot] = gone
        return slot

    def _place(self, seq_id: int, seq: HeldSeq, hits: list, slot: Optional[int] = None,
               copy: Optional[tuple] = None) -> None:
        """Put ``seq`` on ``slot``, by default a free slot already mapping its hits, else the
        free slot with the most mapped pages: shared ``hits`` first (they hold refs before any
        reclaim can run), then private pages, backed as their fill needs; then ``copy``
        (source group, tokens) into its page after the hits."""
        if slot is None and hits:   # a free slot still mapping the first hit at page 0
            slot = self.slots.free_slot_mapping(hits[0])
        slot = self._occupy(seq_id, seq, slot)
        self._share_into(slot, hits)
        if copy is not None:
            self._hold(copy[0])           # no reclaim below may take the source
        n, tpp = seq.num_tokens, self.tokens_per_page
        seq.units = list(hits) + [self._grow_page(slot, pi)
                                  for pi in range(len(hits), -(-n // tpp))]
        self._fill_units(seq.units, len(hits) * tpp, n)     # (fresh groups: fill 0)
        self._live += n - len(hits) * tpp
        self._cap_sum += len(seq.units) * tpp
        self._tok_sum += n
        self._put_seq(seq_id, seq)
        self._fit(seq.units[len(hits):], seq_id)
        if copy is not None:
            copy_tokens(self, seq, len(hits), *copy)

    def _share_into(self, slot: int, groups: list) -> None:
        """Hold ``groups`` (page index -> group) and map each under ``slot`` where it is not
        mapped already (the same physical pages at a second address: no copy)."""
        for pi, g in enumerate(groups):
            if g is not None:         # None: behind a window, given back
                self._hold(g)
                self._share_page(slot, pi, g)

    def _can_place(self) -> bool:
        return bool(self.slots.free)

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None,
                 slot: Optional[int] = None, share_from: Optional[tuple] = None,
                 lookup: bool = True) -> int:
        """As :meth:`MemoryManager.allocate`; ``slot`` places the sequence on that free slot
        (e.g. batch row b on slot b) instead of the one with the most pages still mapped."""
        found = token_ids if lookup else None      # (no lookup: no hit, no query counted)
        self._check_new(seq_id)
        self._check_length(num_tokens)
        if slot is not None:
            self.slots.check_free(seq_id, slot)
        elif not self.slots.free:
            raise OutOfCapacityError(f"sequence {seq_id}: all {self.num_slots} slots are in use")
        hits = self._hits(num_tokens, found, namespace, share_from)
        need = self._need(num_tokens, hits)
        if need > self._available_units():
            self._raise_no_room(f"sequence {seq_id} needs {self._units_text(need)}")
        copy = block_hit(self, num_tokens, found, namespace, hits, need)
        seq = self._new_seq(num_tokens, token_ids, namespace)
        self._place(seq_id, seq, hits, slot, copy)
        self._register_prompt(seq, hits)
        hit_tokens = self._count_prefix(found, num_tokens, hits)
        if copy is not None:
            self.prefix_hits += copy[1]
            self.block_hit_tokens += copy[1]
            hit_tokens += copy[1]
        return hit_tokens

    # -- block publish and forgetting (blocks.py) --
    def _publish(self, seq: HeldSeq, computed_tokens: int) -> None:
        first = seq.published
        UnitOps._publish(self, seq, computed_tokens)
        if self.blocks is not None and seq.ids is not None:
            self.blocks.publish_pages(seq, first, min(computed_tokens, seq.num_tokens),
                                      self.tokens_per_page,
                                      namespace_root(seq.namespace, self.model.kv_encoding))

    def _forget_blocks(self, g: int) -> None:
        if self.blocks is not None:
            self.blocks.drop(g)

    def _reached(self, seq: HeldSeq) -> list:      # (unpublish.py) and its page's blocks
        return reached_groups(self, seq)

    # blocks live only on held and cached groups (check_integrity): evicted or unretained, gone
    # (KindRules' _evict and _unheld)
    def _retained(self, g: int) -> int:
        """A group nobody holds stays cached while it holds a registered full page or published
        blocks (a partial page; those count as its tokens): the policy orders both, by group."""
        return self.tokens_per_page if g in self.prefix.by_unit else \
            self.blocks.blocks_of(g) * self.block_tokens if self.blocks is not None else 0

    def check_integrity(self) -> None:
        check_vmem(self)

    def _check_idle_memory(self) -> None:
        idle_vmem(self)

    # -- growth --
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        new = seq.num_tokens + num_tokens
        if seq.units and new <= self._room_tokens(seq.units) and self._refs[seq.units[-1]] == 1:
            return True      # hot path: room in a private last page
        return new <= self.max_seq_len and self._growth(seq, num_tokens) <= self._available_units()

    def _grow(self, seq_id: int, seq: HeldSeq, old: int, end: int) -> None:
        tpp, slot = self.tokens_per_page, seq.slot
        first = max(old - 1, 0) // tpp
        if old % tpp and self._refs[seq.units[-1]] > 1:
            self._copy_on_write(seq, len(seq.units) - 1)
        before = len(seq.units)
        for pi in range(before, -(-end // tpp)):
            seq.units.append(self._grow_page(slot, pi))
        self._cap_sum += (len(seq.units) - before) * tpp
        self._fill_units(seq.units, old, end)
        self._live += end - old
        self._tok_sum += end - old
        self._fit(seq.units[first:], seq_id)

    def _copy_on_write(self, seq: HeldSeq, pi: int) -> None:
        """The writer of a shared partial page moves to a new group holding a copy."""
        slot, old = seq.slot, seq.units[pi]
        new = self._take_group()                  # old has refs >= 2: never reclaimed here
        self._unhold(old)
        self._unmap(slot, pi)
        self._map(slot, pi, new)
        for k in range(len(self.kinds)):          # BYTES: back the copy as far as the source
            self._back(new, k, self.table.backed(k, old), self.slots.owner[slot])
        src_slot, src_pi = min(self.slots.maps[old])   # same physical group wherever it is mapped
        for k, kind in enumerate(self.kinds):
            if self.table.extent(k, old):
                self._ops.append(CopyExtent(src_slot, src_pi, slot, pi, kind.name,
                                            owner=self.slots.owner[slot],
                                            member_pages=self.table.backed(k, old)))
        self._touch(new)
        self._fill[new] = self._fill[old]
        self._live += self._fill[old]
        seq.units[pi] = new

    # -- fork and release --
    def can_fork(self, parent_id: int) -> bool:
        self._seq(parent_id)
        return len(self.slots.free) > 0

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        self._check_new(child_id)
        if not self.slots.free:
            self._raise_no_room(f"forking sequence {parent_id}: all {self.num_slots} slots in use")
        child = parent.copy()
        self._share_into(self._occupy(child_id, child), child.units)
        self._cap_sum += len(held_units(child)) * self.tokens_per_page
        self._tok_sum += child.num_tokens - dropped_units(child) * self.tokens_per_page
        self._put_seq(child_id, child)

    def _swap_location(self, seq: HeldSeq) -> dict:
        return {"slot": seq.slot}

    def _release(self, seq: HeldSeq) -> None:
        self._unmap_behind(seq.slot)     # windowed kinds given back: cannot stay mapped
        held = held_units(seq)
        for g in reversed(held):        # tail pages enter the LRU first: reclaimed first
            self._unhold(g)
        self._cap_sum -= len(held) * self.tokens_per_page
        self._tok_sum -= seq.num_tokens - (len(seq.units) - len(held)) * self.tokens_per_page
        self.slots.vacate(seq.slot)
        seq.units, seq.slot = [], -1

    # -- swap hooks --
    def _fresh_units(self, seq: HeldSeq, extra_tokens: int = 0) -> Optional[int]:
        if not self.slots.free:
            return None
        return self.geometry.num_members * self.geometry.slot_member_pages(seq.num_tokens
                                                                           + extra_tokens)

    def _places_for(self, count: int) -> bool:
        return len(self.slots.free) >= count

    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        self._place(seq_id, seq, [])
        self._republish(seq)
