"""The vmem manager's integrity check: every invariant of its slots, page groups, mappings,
reference counts, prefix cache and running sums, recomputed from scratch and compared."""
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
        assert len(set(self._free)) == len(self._free)
        registered, spare = self.prefix.by_unit, self._spare_groups()
        assert not spare & set(self._free), "a group both free and spare"
        assert all(refs[g] == 0 and not maps[g] and g not in registered
                   for g in self._free + sorted(spare))
        assert set(self._reclaimable) == {g for g in range(self.num_groups)
                                          if not refs[g] and maps[g] and g not in registered}
        cached = set(self._cache)
        assert len(cached) == len(self._cache)
        assert cached == {g for g in registered if not refs[g]}, "cached: registered, unheld"
        held = sum(1 for g in range(self.num_groups) if refs[g])
        assert held + len(self._free) + len(self._reclaimable) + len(cached) + len(spare) == \
            self.num_groups, "free + reclaimable + cached + held (+ spare) == total"
        assert self._live == sum(self._fill[g] for g in range(self.num_groups) if refs[g])
        assert self._cap_sum == sum(len(held_units(s)) * tpp for s in self._seqs.values())
        assert self._tok_sum == sum(s.num_tokens - dropped_units(s) * tpp for s in self._seqs.values())
        self.prefix.check()
        self._swap_integrity()
        self._check_parts(refs, maps)

    def _spare_groups(self) -> set:
        """Group ids with no pages bound (hybrid.py); none where every group has fixed pages."""
        return set()

    def _check_parts(self, refs: list, maps: list) -> None:
        """The part invariants of a hybrid pool (hybrid.py); nothing else has parts."""
