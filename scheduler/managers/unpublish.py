"""Unpublish: a sequence's content made unfindable, for a request that failed.

A request fails when its work keeps failing (runtime/engine/lifecycle.py): a forward whose
logits were NaN, say, after an earlier step wrote non-finite K/V that no check saw. Publish on
compute (units.py) has by then made its computed full units findable; if they stayed, every
later request with that prefix would read them and fail too (a shared system prompt: every
tenant). So a failed sequence is unpublished before it is freed:

    resident   every unit it holds (its hits and its own) loses its registration (a vmem
               group its blocks too), with every registration chained below it; then, as
               for a swapped one, what its keys still reach (a vmem block hit's source group)
    swapped    the same for the units its published keys reach (cached, or held by others)
    then       it publishes nothing more (``free`` included): its ids and keys are forgotten
    forgotten  (preempted for recompute, then failed while waiting: the manager holds no
               record) the same for the units its token ids reach under its namespace, keyed
               as ``allocate`` keys them (``unpublish_tokens``)

A unit others still hold stays theirs, unfindable, and goes back to the pool when the last
holder lets go; one nobody holds goes back now. Every change logs to the manager's journal.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .prefix import HeldSeq, drop_cached_chain


class Unpublishing:
    """Mixed into UnitOps (over its fields: ``prefix``, ``_refs``, ``_cache``, ``_cell``,
    ``_swapped``, its ``_unheld`` and ``_prompt_keys``)."""

    def unpublish(self, seq_id: int) -> None:
        """As ``MemoryManager.unpublish``: nothing ``seq_id`` (resident or swapped) published or
        hit can be found again, and it publishes nothing more. UnknownSequenceError (nothing
        changed) for a sequence neither resident nor swapped."""
        seq = self._swapped.get(seq_id)
        if seq is None:
            seq = self._changing(seq_id)
            self._drop_reached([u for u in self._unit_ids(seq) if u is not None])
        else:
            self._cell.record(seq)
        self._drop_all_reached(seq)   # a vmem block hit's source: held by none of its pages
        seq.keys, seq.ids = [], None      # its content unknown: never published again

    def unpublish_tokens(self, token_ids: Sequence[int], namespace: Optional[str]) -> None:
        """As ``MemoryManager.unpublish_tokens``: the units a prompt of ``token_ids`` under
        ``namespace`` reaches in the index lose their registrations, as a swapped sequence's
        do (``_reached`` over a record of those tokens, keyed as ``allocate`` keys them)."""
        ids = list(token_ids)
        gone = HeldSeq(len(ids), ids, namespace)
        gone.keys = list(self._prompt_keys(ids, namespace))
        gone.published = len(gone.keys)
        self._drop_all_reached(gone)

    def _drop_all_reached(self, seq: HeldSeq) -> None:
        """``_drop_reached`` what a prompt of ``seq``'s published keys reaches, until it
        reaches nothing: a vmem match names the groups holding the MOST blocks of the page
        after its whole-page hits, so a shorter copy of those blocks (a block hit's source,
        or the copy it made) is found only once the longer one is gone."""
        dropped: set = set()
        units = self._reached(seq)
        while units:
            self._drop_reached(units)
            dropped.update(units)
            units = [u for u in self._reached(seq) if u not in dropped]

    def _drop_reached(self, units: list) -> None:
        """Each of ``units`` loses its registration (``_drop_findable``); a cached one nobody
        holds goes back to the pool now."""
        for unit in units:
            self._drop_findable(unit)
            if not self._refs[unit] and unit in self._cache:   # cached: nobody needs it now
                self._cache.remove(unit)
                self._cache.forget(unit)
                self._unheld(unit)

    def _reached(self, seq: HeldSeq) -> list:
        """The units a prompt of swapped ``seq``'s published keys reaches in the index."""
        return self.prefix.match(seq.keys[:seq.published])

    def _drop_findable(self, unit: int) -> None:
        """``unit``'s registration goes, with every one chained below it (those below that
        nobody holds go back to the pool)."""
        drop_cached_chain(self.prefix, unit, self._refs, self._cache, self._unheld)
