"""HybridVmemManager: the vmem per-layer manager of a hybrid model (full-attention layers beside
sliding-window ones: Gemma 2/3, Cohere2). Behind the window it gives back the windowed layers'
pages of a group while the full layers keep theirs.

Each page group has two PARTS (``PageGeometry.part_members``): FULL, the K/V members of the full
layers (``full_pages`` = 2 * L_full * k pages), and WINDOW, those of the windowed layers
(``window_pages`` = 2 * L_win * k). The pool is counted in PAGES (``pool_pages``, one PageLedger whose
tenants are the two kinds); a group takes pages for both parts when it is taken for new content
and gives a part's pages back to the ledger when no holder reads it (no op: it is mapped
nowhere by then). Group ids are plentiful (``pool_pages // full_pages``). A group is

    spare      no pages bound, mapped nowhere, refs 0            in ``_spare``
    free       both parts bound, mapped nowhere, refs 0          in ``_free``
    reclaimable, cached, used                                    as in vmem.py (both parts bound)
    partial    used, its WINDOW part released                    in ``_partial``

A mapping (slot, pi) -> g is WHOLE (both parts) except below a live slot's window frontier
``_win_gone[slot]``: there its owner dropped the WINDOW part and only FULL is mapped. A group's
WINDOW part is released as soon as no holder needs it (``_win_drop[g] == refs[g]``: every
holder dropped it): whole mappings of it elsewhere (deferred reclamation) are unmapped first
and its prefix registration goes (an incomplete group is never a hit). A partial group whose
last holder goes is unmapped (FULL) and released (FULL): it becomes spare.

Ops (kind 0 is "full", kind 1 "window-W"; each names the part's pool pages):
    MapExtent(s, pi, "full", pages) + MapExtent(s, pi, "window-W", pages)   a whole mapping
    MapExtent(s, pi, "full", pages)       FULL only (a fork of a sequence behind its window)
    UnmapExtent(s, pi, "window-W")        the window part leaves that mapping; FULL stays
    UnmapExtent(s, pi, "full")            the FULL part of a FULL-only mapping
CopyExtent, SwapOut and SwapIn only ever name whole mappings.
"""
from __future__ import annotations

from typing import Optional

from ..errors import OutOfCapacityError
from ..geometry import PART_FULL, PART_WINDOW
from ..layout import PoolBacking
from .base import MemoryStats
from .journal import JList, JSet
from .kinds import KindSpec
from .prefix import HeldSeq
from .vmem import VmemManager

FULL, WINDOW = (0,), (1,)      # the kinds (indexes into ``kinds``) of each part


class HybridVmemManager(VmemManager):
    """VmemManager whose groups have FULL and WINDOW parts over a pool of ``pool_pages`` pages
    (``make_manager("vmem", ...)`` builds one for a hybrid model in the per-layer layout).
    Guarantees, on top of VmemManager's: pages bound <= ``pool_pages``; a live sequence's
    groups have FULL mapped at every page it holds and WINDOW from its window frontier on."""

    def __init__(self, model, cache_bytes: int, max_seq_len_tokens: int, **kwargs) -> None:
        super().__init__(model, cache_bytes, max_seq_len_tokens, **kwargs)
        assert self.geometry.split, "a hybrid manager needs a split (hybrid per-layer) geometry"
        cell = self._cell
        self._free = JList(cell)                          # no group has pages before it is taken
        self._spare = JList(cell, range(self.num_groups - 1, -1, -1))
        self._partial = JSet(cell)
        self._win_drop = JList(cell, [0] * self.num_groups)   # holders of g, WINDOW unmapped
        self._win_gone = JList(cell, [0] * self.num_slots)    # slot -> leading FULL-only pages
        self._init_window(model.local_window_tokens)

    def _pool(self, cache_bytes: int, whole_groups: int) -> tuple:
        pool_pages = cache_bytes // self.page_bytes
        self.full_pages = self.geometry.pages_per_part(PART_FULL)
        self.window_pages = self.geometry.pages_per_part(PART_WINDOW)
        return pool_pages // self.full_pages, pool_pages  # a group with pages holds FULL ones

    def _kinds(self, model) -> tuple:
        geo = self.geometry
        return (KindSpec("full", geo.part_layers(PART_FULL)),
                KindSpec(f"window-{model.local_window_tokens}", geo.window_layers,
                         model.local_window_tokens))

    def _back_fixed(self) -> None:
        """Nothing is taken before a group is (``_take_group``)."""

    def _take_pages(self, g: int) -> None:
        for k in (0, 1):
            self._extents[k][g] = self.ledger.take(self.full_pages if k == 0 else
                                                   self.window_pages, self.kinds[k].name)

    def _give_pages(self, g: int, kinds: tuple) -> None:
        """``g``'s pages of ``kinds`` back to the ledger (mapped nowhere by now)."""
        for k in kinds:
            self.ledger.give(self._extents[k][g])
            self._extents[k][g] = ()

    pool_backing = PoolBacking.PARTS
    _FIXED_FIELDS = VmemManager._FIXED_FIELDS | {"pool_pages", "full_pages", "window_pages"}
    _JOURNALED_FIELDS = VmemManager._JOURNALED_FIELDS | {"_spare", "_partial", "_win_drop",
                                                         "_win_gone"}

    # -- page accounting --
    @property
    def bound_pages(self) -> int:
        """Pages bound to some group's part (FULL of every non-spare group, WINDOW of every
        non-spare, non-partial one)."""
        return self.pool_pages - self.ledger.free_pages

    @property
    def free_pages(self) -> int:
        """Pool pages bound to no group."""
        return self.ledger.free_pages

    def bound_parts(self, group: int) -> tuple:
        """The parts of ``group`` that have pages bound."""
        return tuple(p for p, k in ((PART_FULL, 0), (PART_WINDOW, 1)) if self._extents[k][group])

    def _kinds_at(self, slot: int, pi: int):
        return FULL if pi < self._win_gone[slot] else range(2)

    def full_only_pages(self, slot: int) -> int:
        return self._win_gone[slot]

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self.pool_pages // self.pages_per_group * self.tokens_per_page)

    def _available_units(self) -> int:
        reusable = len(self._free) + len(self._reclaimable) + len(self._cache)
        return reusable + self.free_pages // self.pages_per_group

    def _take_group(self) -> int:
        """A whole group for new content: a free one (it has pages), else a spare id that
        takes free pages from the ledger, else reclaimed as in vmem.py."""
        if not self._free and self.free_pages >= self.pages_per_group:
            g = self._spare.pop()     # ids outnumber groups with pages: never empty here
            self._take_pages(g)
            self._touch(g)
            self._refs[g], self._fill[g] = 1, 0
            return g
        return super()._take_group()

    def _unheld(self, g: int) -> None:
        if g in self._partial:        # mapped nowhere: its last FULL-only mapping went
            self._partial.remove(g)
            self._give_pages(g, FULL)
            self._spare.append(g)
            return
        super()._unheld(g)

    def _unhold(self, g: int) -> None:
        super()._unhold(g)
        if self._refs[g] and g not in self._partial and self._win_drop[g] == self._refs[g]:
            self._release_window(g)   # the holder that still read its window went

    # -- behind the window --
    def _window_dropped(self, seq: HeldSeq) -> int:
        return self._win_gone[seq.slot]

    def _shareable(self, unit: Optional[int]) -> bool:
        return unit is not None and unit not in self._partial

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """Unmap the WINDOW part of the sequence's pages wholly before ``computed_tokens - W + 1``
        (the last page always stays whole); release it where no holder needs it any more."""
        seq = self._changing(seq_id)
        first_read = computed_tokens - self._window + 1
        behind = min(max(first_read, 0) // self.tokens_per_page, len(seq.units) - 1)
        slot = seq.slot
        for pi in range(self._win_gone[slot], behind):
            g = seq.units[pi]
            self._emit_unmap(slot, pi, g, WINDOW)
            self._win_gone[slot] = pi + 1
            self._win_drop[g] += 1
            if self._win_drop[g] == self._refs[g]:
                self._release_window(g)

    def _release_window(self, g: int) -> None:
        """No holder reads g's WINDOW part: unmap its whole mappings (none is a holder's) and
        release the part; the group can no longer serve a prefix hit."""
        for slot, pi in sorted(self._maps[g]):
            if pi >= self._win_gone[slot]:
                self._unmap(slot, pi)
        self.prefix.drop(g)
        self._cache.forget(g)
        self._partial.add(g)
        self._give_pages(g, WINDOW)

    # -- placement and release --
    def _occupy(self, seq_id: int, seq: HeldSeq, slot: Optional[int] = None) -> int:
        # a fork's record still names its parent's slot: it inherits the parent's frontier
        gone = self._win_gone[seq.slot] if seq.slot >= 0 else 0
        slot = super()._occupy(seq_id, seq, slot)
        self._win_gone[slot] = gone
        return slot

    def _share_page(self, slot: int, pi: int, g: int) -> None:
        if pi >= self._win_gone[slot]:
            super()._share_page(slot, pi, g)
            return
        self._win_drop[g] += 1        # a fork's page behind the window: FULL only
        pages = self._pages[slot]
        if pages.get(pi) == g:        # a whole deferred mapping of it: drop its WINDOW part
            self._emit_unmap(slot, pi, g, WINDOW)
            return
        if pi in pages:               # a whole deferred mapping of another group
            self._unmap(slot, pi, range(2))
        pages[pi] = g
        self._maps[g].add((slot, pi))
        self._emit_map(slot, pi, g, FULL)

    def _release(self, seq: HeldSeq) -> None:
        """FULL-only mappings cannot stay for deferred reclamation (a later sequence on the slot
        would find windowed members missing): unmapped first, then released as in vmem.py."""
        slot, pages = seq.slot, self._pages[seq.slot]
        for pi in range(self._win_gone[slot]):
            g = pages.pop(pi)
            self._maps[g].discard((slot, pi))
            self._emit_unmap(slot, pi, g, FULL)
            self._win_drop[g] -= 1
        self._win_gone[slot] = 0
        super()._release(seq)

    # -- accounting in pages --
    def _tokens_of_pages(self, pages: int) -> int:
        """Pages as tokens at full allocation (a group's pages hold tokens_per_page tokens)."""
        return pages * self.tokens_per_page // self.pages_per_group

    def stats(self) -> MemoryStats:
        """Tokens at full allocation (bytes = tokens * bytes_per_token, rounded down to
        tokens): ``total_tokens`` is the pool, ``free_tokens`` its unbound pages and free
        groups, so ``allocated_bytes`` is about the pages bound; ``live_tokens`` counts a
        partial group's tokens in its FULL pages only (its WINDOW content is gone)."""
        total = self._tokens_of_pages(self.pool_pages)
        free = self._tokens_of_pages(self.free_pages + len(self._free) * self.pages_per_group)
        gone = len(self._partial) * self.tokens_per_page * self.window_pages   # partial: full
        live = (self._live * self.pages_per_group - gone) // self.pages_per_group
        return MemoryStats(total_tokens=total, allocated_tokens=total - free,
                           live_tokens=live, free_tokens=free,
                           end_waste_tokens=self._cap_sum - self._tok_sum,
                           bytes_per_token=self.bytes_per_token)

    def kv_cache_usage(self) -> float:
        """Pages bound to used groups over the pool (free, reclaimable and cached groups count
        as unused, as in vmem.py)."""
        unused = len(self._free) + len(self._reclaimable) + len(self._cache)
        return (self.bound_pages - unused * self.pages_per_group) / self.pool_pages

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(
            f"{what}: {self.free_pages} of {self.pool_pages} pages unbound (a group takes "
            f"{self.pages_per_group}), {len(self._free)} free + {len(self._reclaimable)} "
            f"reclaimable + {len(self._cache)} cached page groups, {len(self._free_slots)} free slots")

    # -- integrity (VmemIntegrity hooks) --
    def _spare_groups(self) -> set:
        return set(self._spare)

    def _check_parts(self, refs: list, maps: list) -> None:
        assert len(set(self._spare)) == len(self._spare) and not self._partial & set(self._spare)
        self.ledger.check_integrity()
        spare = set(self._spare)
        for g in range(self.num_groups):
            full, window = (len(self._extents[k][g]) for k in (0, 1))
            assert full == (0 if g in spare else self.full_pages), ("full pages", g)
            assert window == (0 if g in spare or g in self._partial else self.window_pages), g
        drops = [0] * self.num_groups
        for slot, gone in enumerate(self._win_gone):
            seq = self._seqs.get(self._owner[slot])
            assert gone == 0 or (seq is not None and gone <= len(seq.units) - 1), ("frontier", slot)
            for pi in range(gone):
                drops[seq.units[pi]] += 1
        assert drops == self._win_drop, "window drops per group"
        for g in range(self.num_groups):
            if g in self._partial:
                assert refs[g] and drops[g] == refs[g] and g not in self.prefix.by_unit, g
                assert all(pi < self._win_gone[s] for s, pi in maps[g]), ("whole partial", g)
            else:
                assert drops[g] < refs[g] or refs[g] == 0 == drops[g], ("window unreleased", g)
