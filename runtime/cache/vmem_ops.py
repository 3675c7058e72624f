"""VMemOps: how vmem ops become driver calls, "range page <- named pool page", each checked
against the replica before any memory is touched and each inverse journaled.

Member j of a layer kind under (slot, page_index) spans the k = ``pages_per_member`` range
pages from ``_first_page`` (vmem_cache's module docstring); a MapExtent names one pool page per
member per member page, in the order of the diagram in scheduler/managers/base.py:

    range page  _first_page(j, slot, page_index) + i   <-   pool_pages[(i - first_page) * M + c]

(member number c of the kind's M, member page i from first_page). The replica is
(slot, page_index) -> {kind: pool pages mapped, from member page 0}; binding a plan checks and
updates it in plan order on the step thread (each change journaled), so a refused op (a page
mapped twice at one place, a pool page outside the pool, an unmap of nothing, a copy into less)
raises CacheStateError with nothing changed, and applying (inline or on the background mapper,
layer by layer) only reads each op's resolved primitives. ``ReleasePages`` (the pool shrank)
discards pages mapped nowhere, after every layer's unmaps (the last op group); a page the plan
released cannot be mapped again in the same plan. ``LoadAdapter`` / ``EvictAdapter`` (a LoRA
adapter's pages mapped into, or out of, a VirtualRange of its own) apply with that last group
too, in plan order; no KV op may name a page a resident adapter holds (cache/adapters.py).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from vmemkv.scheduler.plan import (CopyExtent, EvictAdapter, LoadAdapter, MapExtent,
                                   ReleasePages, SwapIn, SwapOut, UnmapExtent)

from ..errors import CacheConfigError, CacheStateError
from .journal import PlanJournal


class Kind(NamedTuple):
    """One layer kind as the cache sees it: its members (page-group member indexes j, in
    order), its layers and the widest window they read within (None: every token)."""
    name: str
    layers: tuple
    members: tuple
    window: Optional[int]


def cache_kinds(kinds: tuple, geometry, layer_window) -> dict:
    """{name: Kind} of a layout's ((name, layers), ...); CacheConfigError unless every layer
    is in one kind (one kind in the interleaved layout)."""
    layers = sorted(l for _, ls in kinds for l in ls)
    if layers != list(range(geometry.num_layers)) or (not geometry.per_layer and len(kinds) != 1):
        raise CacheConfigError(f"the layer kinds must cover each of the {geometry.num_layers} "
                               f"layers once (one kind interleaved), got {kinds!r}")
    out = {}
    for name, ls in kinds:
        members = tuple(j for l in ls for j in (2 * l, 2 * l + 1)) if geometry.per_layer else (0, 1)
        windows = [layer_window(l) for l in ls]
        out[name] = Kind(name, tuple(ls), members, None if None in windows else max(windows))
    return out


class VMemOps:
    """Mixed into VMemKVCache: binding a plan against the replica, and applying it."""

    # -- binding (step thread): check, update the replica, resolve primitives --
    def _bind_ops(self, bound: Sequence, journal: PlanJournal) -> list:
        """Every op paired with what applying it needs, the replica updated in plan order; all
        or nothing (CacheStateError naming the op, the replica and swap space as before)."""
        undo, out = journal.replica_undo.append, []
        self._released_in_plan = set()
        try:
            for op, buffer in bound:
                out.append((op, self._bind_op(op, buffer, undo)))
        except BaseException as error:       # a refusal, or a KeyboardInterrupt part way
            for action in reversed(journal.replica_undo):
                action()
            journal.replica_undo.clear()
            self._swapped = journal.swapped_before
            if not isinstance(error, CacheStateError):
                raise
            raise CacheStateError(f"plan refused at op {len(out)}, nothing changed: {error}") from None
        return out

    def _bind_op(self, op, buffer, undo):
        if isinstance(op, MapExtent):
            if self._released_in_plan.intersection(op.pool_pages):
                raise CacheStateError(f"{op!r} maps a pool page released earlier in the plan")
            if self._adapters and self._adapter_held_units().intersection(op.pool_pages):
                raise CacheStateError(f"{op!r} maps a pool page a resident adapter holds")
            return self._bind_map(op, undo)
        if isinstance(op, LoadAdapter):
            return self._bind_adapter(op, undo, lambda: self._kv_mapped() | self._released_in_plan)
        if isinstance(op, EvictAdapter):
            return self._bind_adapter(op, undo)
        if isinstance(op, ReleasePages):
            return self._bind_release(op)
        if isinstance(op, UnmapExtent):
            return self._bind_unmap(op, undo)
        if isinstance(op, CopyExtent):
            kind = self._kind(op)
            src = len(self._extent(op.src_slot, op.src_page_index, kind.name)) // len(kind.members)
            dst = len(self._extent(op.dst_slot, op.dst_page_index, kind.name)) // len(kind.members)
            if op.num_tokens is not None:
                return self._bind_token_copy(op, kind, src, dst)
            if not src or dst < src:
                raise CacheStateError(f"{op!r}: the source must be mapped and the destination "
                                      f"mapped at least as far ({src} and {dst} member pages)")
            if op.member_pages is not None and op.member_pages != src:
                raise CacheStateError(f"{op!r} copies {op.member_pages} member pages, but the "
                                      f"source has {src} mapped")
            return {j: [(self._first_page(j, op.dst_slot, op.dst_page_index) + i,
                         self._first_page(j, op.src_slot, op.src_page_index) + i)
                        for i in range(src)] for j in kind.members}
        if isinstance(op, (SwapOut, SwapIn)):
            for kind in self._kinds.values():
                gap = self._unbacked(op.slot, kind, 0, op.num_tokens)
                if gap is not None:
                    raise CacheStateError(f"{op!r} touches token {gap} of slot {op.slot}, which "
                                          f"has no {kind.name!r} memory mapped")
        return buffer

    def _bind_release(self, op: ReleasePages) -> tuple:
        pages = op.pool_pages
        if not isinstance(pages, tuple) or len(set(pages)) != len(pages) or any(
                isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.pool_pages
                for p in pages):
            raise CacheStateError(f"{op!r}: pool_pages must be distinct pages of 0.."
                                  f"{self.pool_pages - 1}")
        mapped = (self._kv_mapped() | self._adapter_held_units()).intersection(pages)
        if mapped:
            raise CacheStateError(f"{op!r} releases pool pages still mapped: "
                                  f"{sorted(mapped)[:8]}")
        self._released_in_plan.update(pages)
        return tuple(self._pool_pages[p] for p in pages)

    def _kv_mapped(self) -> set:
        """Pool pages the replica maps in the KV range."""
        return {p for spots in self._spots for kinds in spots.values()
                for extent in kinds.values() for p in extent}

    def _bind_token_copy(self, op: CopyExtent, kind: "Kind", src: int, dst: int) -> dict:
        """{member: (dst byte offset, src byte offset, bytes)}: tokens [0, num_tokens) of every
        member of ``kind`` (a member's tokens are consecutive ``token_bytes`` rows over its k
        consecutive range pages), both extents mapped as far as those bytes."""
        geo, n = self.geometry, op.num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= self.tokens_per_page:
            raise CacheStateError(f"{op!r}: num_tokens must be in 1..{self.tokens_per_page}")
        pages = geo.member_pages_for(n)
        if src < pages or dst < pages:
            raise CacheStateError(f"{op!r}: {n} tokens need {pages} member pages mapped at the "
                                  f"source and the destination ({src} and {dst} are)")
        if (op.src_slot, op.src_page_index) == (op.dst_slot, op.dst_page_index):
            raise CacheStateError(f"{op!r}: source and destination are one place")
        num_bytes = n * geo.token_bytes
        return {j: (self._first_page(j, op.dst_slot, op.dst_page_index) * self.page_bytes,
                    self._first_page(j, op.src_slot, op.src_page_index) * self.page_bytes,
                    num_bytes) for j in kind.members}

    def _kind(self, op) -> "Kind":
        kind = self._kinds.get(op.kind)
        if kind is None:
            raise CacheStateError(f"{op!r} names kind {op.kind!r}; this cache's kinds are "
                                  f"{', '.join(self._kinds)}")
        slots = (op.src_slot, op.dst_slot) if isinstance(op, CopyExtent) else (op.slot,)
        spots = (op.src_page_index, op.dst_page_index) if isinstance(op, CopyExtent) else \
            (op.page_index,)
        if any(not 0 <= s < self.config.max_batch for s in slots) or \
                any(not 0 <= p < self.pages_per_slot for p in spots):
            raise CacheStateError(f"{op!r} names a slot or page index outside 0..."
                                  f"{self.config.max_batch - 1} / 0..{self.pages_per_slot - 1}")
        return kind

    def _extent(self, slot: int, page_index: int, kind: str) -> tuple:
        return self._spots[slot].get(page_index, {}).get(kind, ())

    def _set_extent(self, slot: int, page_index: int, kind: str, pages: tuple, undo) -> None:
        spots = self._spots[slot]
        old = spots.get(page_index)
        # the undo first: it restores ``old`` whether or not an interrupt let the write happen
        undo(lambda: spots.__setitem__(page_index, old) if old is not None else
             spots.pop(page_index, None))
        new = {k: v for k, v in (old or {}).items() if k != kind}
        if pages:
            new[kind] = pages
        if new:
            spots[page_index] = new
        else:
            spots.pop(page_index, None)

    def _bind_map(self, op: MapExtent, undo) -> dict:
        kind = self._kind(op)
        n, k = len(kind.members), self.geometry.pages_per_member
        pages, have = op.pool_pages, self._extent(op.slot, op.page_index, kind.name)
        if not isinstance(pages, tuple) or not pages or len(pages) % n:
            raise CacheStateError(f"{op!r}: pool_pages must be a non-empty tuple of a page per "
                                  f"member ({n}) per member page")
        if any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.pool_pages
               for p in pages):
            raise CacheStateError(f"{op!r} names a pool page outside 0..{self.pool_pages - 1}")
        m = len(pages) // n
        if op.first_page != len(have) // n or op.first_page + m > k:
            raise CacheStateError(f"{op!r}: {len(have) // n} member pages of {kind.name!r} are "
                                  f"mapped there (a page mapped twice at one place, or past "
                                  f"the {k} of a member)")
        self._set_extent(op.slot, op.page_index, kind.name, have + pages, undo)
        return {j: [(self._first_page(j, op.slot, op.page_index) + op.first_page + i,
                     pages[i * n + c]) for i in range(m)] for c, j in enumerate(kind.members)}

    def _bind_unmap(self, op: UnmapExtent, undo) -> dict:
        kind = self._kind(op)
        n, have = len(kind.members), self._extent(op.slot, op.page_index, kind.name)
        if not 0 <= op.first_page < len(have) // n:
            raise CacheStateError(f"{op!r}: an unmap of nothing ({len(have) // n} member pages "
                                  f"of {kind.name!r} are mapped there)")
        self._set_extent(op.slot, op.page_index, kind.name, have[:op.first_page * n], undo)
        return {j: [(self._first_page(j, op.slot, op.page_index) + i, None)
                    for i in range(op.first_page, len(have) // n)] for j in kind.members}

    def _first_page(self, member: int, slot: int, page_index: int) -> int:
        """Range page of member page 0 of what is mapped under (slot, page_index)."""
        return ((member * self.config.max_batch + slot) * self.pages_per_slot + page_index) * \
            self.geometry.pages_per_member

    def _unbacked(self, slot: int, kind: "Kind", start: int, end: int) -> Optional[int]:
        """The first token in [start, end) of ``slot`` whose bytes ``kind`` has not mapped, or
        None (every member page covering them is mapped)."""
        tpp, n, geo, spots = self.tokens_per_page, len(kind.members), self.geometry, self._spots[slot]
        for pi in range(start // tpp, -(-end // tpp)):
            m = len(spots.get(pi, {}).get(kind.name, ())) // n
            backed = tpp if m == geo.pages_per_member else geo.tokens_in_member_pages(m)
            if pi * tpp + backed < min(end, (pi + 1) * tpp):
                return max(start, pi * tpp + backed)
        return None

    # -- applying (step thread or mapper thread) --
    def _apply_layer_group(self, bound: Sequence, group: int,
                           journal: Optional[PlanJournal] = None) -> None:
        """Apply the part of a bound plan that touches op group ``group`` (a layer, or every
        layer interleaved), recording the inverse of every primitive in ``journal``."""
        journal = journal if journal is not None else PlanJournal({})
        rng, members = self.range, self.geometry.members_of(group)
        # one device synchronise for every page this group unmaps, not one per page
        self.driver.prepare_unmap(sum(len(payload.get(j, ())) for op, payload in bound
                                      if isinstance(op, UnmapExtent) for j in members))
        for index, (op, payload) in enumerate(bound):
            journal.op_index = index
            if isinstance(op, MapExtent):
                for j in members:
                    for page_index, pool_page in payload.get(j, ()):
                        # the undo first: it undoes the map however far an interrupt let it go
                        journal.add(lambda pi=page_index: rng.undo_map(pi))
                        rng.map(page_index, self._pool_pages[pool_page])
            elif isinstance(op, UnmapExtent):
                for j in members:
                    for page_index, _ in payload.get(j, ()):
                        page_id = rng.page_at(page_index)
                        journal.add(lambda pi=page_index, pid=page_id: rng.undo_unmap(pi, pid))
                        rng.unmap(page_index)
            elif isinstance(op, CopyExtent) and op.num_tokens is not None:
                for j in members:
                    if j in payload:
                        dst, src, num_bytes = payload[j]
                        self._save_bytes(journal, dst, num_bytes)
                        rng.tensor(dst, num_bytes).copy_(rng.tensor(src, num_bytes))
            elif isinstance(op, CopyExtent):
                for j in members:
                    for dst, src in payload.get(j, ()):
                        self._save_bytes(journal, dst * self.page_bytes, self.page_bytes)
                        rng.copy_page(dst, src)
            elif isinstance(op, SwapOut):
                for layer in self.geometry.layers_of(group):  # buffer: (layers, 2, tokens, heads, dim)
                    self._swap_copy(payload[layer, 0], self._k[layer][op.slot, :op.num_tokens])
                    self._swap_copy(payload[layer, 1], self._v[layer][op.slot, :op.num_tokens])
            elif isinstance(op, SwapIn):
                for layer in self.geometry.layers_of(group):
                    for cache in (self._k[layer], self._v[layer]):
                        target = cache[op.slot, :op.num_tokens]
                        saved = target.clone()
                        journal.add(lambda t=target, s=saved: t.copy_(s))
                    self._swap_copy(self._k[layer][op.slot, :op.num_tokens], payload[layer, 0])
                    self._swap_copy(self._v[layer][op.slot, :op.num_tokens], payload[layer, 1])
            elif isinstance(op, ReleasePages):
                if group == self.geometry.num_op_groups - 1:   # after every layer's unmaps
                    backed = [p for p in payload if self.pool.has_memory(p)]  # (some never were)
                    self.pool.discard(backed)
                    journal.add(lambda ids=backed: self.pool.recommit(ids))
            elif isinstance(op, LoadAdapter):
                if group == self.geometry.num_op_groups - 1:   # after every layer's unmaps
                    self._map_adapter(op.adapter_id, payload)
                    journal.add(lambda name=op.adapter_id: self._unmap_adapter(name))
            elif isinstance(op, EvictAdapter):
                if group == self.geometry.num_op_groups - 1:
                    self._unmap_adapter(op.adapter_id)
                    journal.add(lambda name=op.adapter_id, pages=payload:
                                self._map_adapter(name, pages))
            else:
                raise CacheStateError(f"VMemKVCache cannot execute {op!r}")

    def _save_bytes(self, journal: PlanJournal, offset: int, num_bytes: int) -> None:
        """Keep a copy of bytes about to be overwritten; undo writes them back."""
        view = self.range.tensor(offset, num_bytes)
        saved = view.clone()
        journal.add(lambda: self.range.tensor(offset, num_bytes).copy_(saved))

    def _expected_mappings(self) -> dict:
        """{range page: pool page id} the replica says is mapped."""
        expected = {}
        for slot, spots in enumerate(self._spots):
            for pi, extents in spots.items():
                for name, pages in extents.items():
                    kind = self._kinds[name]
                    n = len(kind.members)
                    for c, j in enumerate(kind.members):
                        first = self._first_page(j, slot, pi)
                        for i in range(len(pages) // n):
                            expected[first + i] = self._pool_pages[pages[i * n + c]]
        return expected
