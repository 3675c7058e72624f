"""The vmem manager's integrity check: every invariant of its slots, page groups, mappings,
reference counts, per-kind extents, prefix cache and running sums, recomputed from scratch and
compared."""
from __future__ import annotations

from .window import dropped_units, held_units


class VmemIntegrity:
    """``check_integrity`` of ``VmemManager`` (a mixin: it reads the manager's state only)."""

    def check_integrity(self) -> None:
        tpp, refs = self.tokens_per_page, [0] * self.num_groups
        for seq_id, seq in self._seqs.items():
            assert self._owner[seq.slot] == seq_id and seq.slot not in self._free_slots
            assert len(seq.units) == -(-seq.num_tokens // tpp), "page count"
            gone = dropped_units(seq)
            assert None not in seq.units[gone:], ("given back past the window's start", seq_id)
            for pi, g in enumerate(seq.units[gone:], start=gone):
                refs[g] += 1
                assert self._pages[seq.slot].get(pi) == g, ("unmapped page in use", seq_id, pi)
                assert self._fill[g] == min(tpp, seq.num_tokens - pi * tpp), ("fill", g)
        assert refs == self._refs, "reference counts"
        maps = [set() for _ in range(self.num_groups)]
        for slot, pages in enumerate(self._pages):
            for pi, g in pages.items():
                maps[g].add((slot, pi))
            free = self._owner[slot] is None
            assert free == (slot in self._free_slots)
        assert maps == list(self._maps), "mapping index"
        assert all(c == len(self._pages[s]) for s, c in self._free_slots.items())
        free, spare = set(self._free), set(self._spare)
        assert len(free) == len(self._free) and len(spare) == len(self._spare)
        assert not spare & free, "a group both free and spare"
        registered = set(self.prefix.by_unit)
        if self.blocks is not None:
            self.blocks.check()
            kept = set(self.blocks.by_group)
            assert all(refs[g] or g in self._cache for g in kept), "blocks of a group gone"
            assert all(self.blocks.blocks_of(g) * self.block_tokens <= self._fill[g]
                       for g in kept), "blocks past a group's fill"
            registered |= kept           # retained like a registered group
        assert all(refs[g] == 0 and not maps[g] and g not in registered for g in free | spare)
        assert set(self._reclaimable) == {g for g in range(self.num_groups)
                                          if not refs[g] and maps[g] and g not in registered}
        cached = set(self._cache)
        assert len(cached) == len(self._cache)
        assert cached == {g for g in registered if not refs[g]}, "cached: retained, unheld"
        held = sum(1 for g in range(self.num_groups) if refs[g])
        assert held + len(free) + len(self._reclaimable) + len(cached) + len(spare) == \
            self.num_groups, "free + reclaimable + cached + held + spare == total"
        assert self._live == sum(self._fill[g] for g in range(self.num_groups) if refs[g])
        assert self._cap_sum == sum(len(held_units(s)) * tpp for s in self._seqs.values())
        assert self._tok_sum == sum(s.num_tokens - dropped_units(s) * tpp for s in self._seqs.values())
        self.prefix.check()
        self._swap_integrity()
        self._check_extents(refs, maps, spare)
        self._check_frontiers(refs, maps)
        names = {kind.name for kind in self.kinds}
        self._check_adapters(lambda tenant: tenant in names)

    def _check_extents(self, refs: list, maps: list, spare: set) -> None:
        """Each group's extents as the backing and release rules say."""
        table, geo, cached = self.table, self.geometry, set(self._cache)
        table.check_integrity()
        assert self.bound_pages <= self.pool_pages, "pages bound"
        assert self._idle == sum(table.pages_of(g) for g in self._reclaimable), "idle pages"
        k_max = geo.pages_per_member
        for g in range(self.num_groups):
            backed = [table.backed(k, g) for k in range(len(self.kinds))]
            kept = [b for k, b in enumerate(backed) if k not in self._win]
            window = [b for k, b in enumerate(backed) if k in self._win]
            if g in spare:
                assert not any(backed), ("spare group keeps pages", g, backed)
                continue
            assert all(b == 0 for b in window) if g in self._partial else \
                len(set(backed)) == 1, ("kinds backed alike", g, backed)
            m = kept[0]
            if self._whole:
                assert m == k_max, ("whole backing", g, m)
            elif refs[g]:
                assert m == geo.member_pages_for(self._fill[g]), ("held backing", g, m)
            elif g in cached:
                full = g in self.prefix.by_unit
                assert m == k_max if full else m >= geo.member_pages_for(self._fill[g]), \
                    ("cached backing", g, m)
            else:
                assert maps[g] and 1 <= m <= k_max, ("reclaimable backing", g, m)

    def _check_frontiers(self, refs: list, maps: list) -> None:
        """The release rule's frontiers: holders that dropped the windowed kinds, per group."""
        drops = [0] * self.num_groups
        for slot, gone in enumerate(self._win_gone):
            seq = self._seqs.get(self._owner[slot])
            assert gone == 0 or (self._win and seq is not None and gone <= len(seq.units) - 1), \
                ("frontier", slot)
            for pi in range(gone):
                drops[seq.units[pi]] += 1
        assert drops == list(self._win_drop), "window drops per group"
        for g in range(self.num_groups):
            if g in self._partial:
                assert refs[g] and drops[g] == refs[g] and g not in self.prefix.by_unit, g
                assert all(pi < self._win_gone[s] for s, pi in maps[g]), ("whole partial", g)
            else:
                assert drops[g] < refs[g] or refs[g] == 0 == drops[g], ("window unreleased", g)
