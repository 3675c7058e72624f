"""Eviction policies of the prefix cache: which cached unit (a full, computed paged block or vmem
page group that nobody holds any more) is overwritten when memory is needed.

A policy only orders units; the manager owns their state. The manager calls

    add(unit, tokens)  the unit's last holder let go and its content stays findable (it is
                   cached), ``tokens`` computed, findable tokens of it (``tokens`` sums them)
    remove(unit)   the unit is held again (a prefix hit) or its content is dropped
    pop()          memory is needed: the unit to evict (the manager then drops its content)

Guarantees of every policy: ``pop`` returns a unit that was added and not removed since (never a
held one); ``len`` counts exactly those units; iteration and ``pop`` are deterministic (ties go
to the unit added first); ``tokens`` is the sum of the cached units' tokens, kept at add,
remove and pop (O(1) to read); every change is undone by a rollback of the manager's transaction
(every container logs to the manager's journal, journal.py, ``hits``'s heap included).

    off    no retention: the managers drop a unit's content when its last holder lets go
    lru    vLLM's free queue: least recently released first; a finished request releases its
           units last-first (a paged hybrid: block k of every group before any block k-1), so
           its tail is evicted before its prefix
    hits   greedy-dual by reuse (this project's): each unit's priority is the eviction clock at
           its release plus its value: the prefix hits it has served, +1 if it holds prompt
           tokens (generated tokens come back only if a client resends them verbatim, which
           chat templates and traces rarely do). The lowest goes first and the clock rises to
           it, so an often-shared prefix (a system prompt, an early conversation turn)
           outlives a cold tail released after it, while nothing stays forever (the clock
           catches up with units that stop being hit)
"""
from __future__ import annotations

import heapq
from typing import Iterator, List, Optional, Tuple

from ..errors import ConfigError
from .journal import JDict, JList, JSet, OrderedUnits, TxnCell, journaled

EVICTION_POLICIES = ("off", "lru", "hits")
DEFAULT_EVICTION = "lru"


class EvictionPolicy:
    """Base: least recently added first (``lru``)."""

    name = "lru"

    def __init__(self, cell: Optional[TxnCell] = None) -> None:
        self._cell = TxnCell() if cell is None else cell
        self._order = OrderedUnits(self._cell)   # oldest release first
        self._tokens_of = JDict(self._cell)      # cached unit -> its computed, findable tokens
        self.tokens = 0                          # their sum (changes through TxnCell.set)

    def journaled_fields(self) -> bool:
        """Every container field is undone by a rollback (journal.journaled); scalar fields
        change only through ``TxnCell.set``."""
        return all(journaled(v) for v in vars(self).values())

    @property
    def retains(self) -> bool:
        """Whether released units stay cached (False only for ``off``)."""
        return True

    def _weigh(self, unit: int, tokens: int) -> None:
        self._tokens_of[unit] = tokens
        self._cell.set(self, "tokens", self.tokens + tokens)

    def _unweigh(self, unit: int) -> None:
        self._cell.set(self, "tokens", self.tokens - self._tokens_of.pop(unit))

    def add(self, unit: int, tokens: int) -> None:
        self._order.add(unit)
        self._weigh(unit, tokens)

    def remove(self, unit: int) -> None:
        self._order.remove(unit)
        self._unweigh(unit)

    def note_hit(self, unit: int) -> None:
        """``unit`` (cached or held) served a prefix hit."""

    def note_generated(self, unit: int) -> None:
        """``unit`` holds generated tokens (appended after allocation), not a prompt's."""

    def forget(self, unit: int) -> None:
        """``unit``'s content was dropped (whatever the policy learnt about it starts again)."""

    def pop(self) -> int:
        unit = self._order.pop_first()
        self._unweigh(unit)
        return unit

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, unit: int) -> bool:
        return unit in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class NoRetention(EvictionPolicy):
    """``off``: the managers never add a unit (they drop its content at release instead)."""

    name = "off"

    @property
    def retains(self) -> bool:
        return False

    def add(self, unit: int, tokens: int) -> None:
        raise AssertionError("off retains nothing: the manager must drop the unit instead")


class HitsPolicy(EvictionPolicy):
    """``hits``: greedy-dual over prefix hits (see the module docstring). O(log n) per call
    (a heap with lazy deletion); the hit counts of a unit reset when its content is dropped."""

    name = "hits"

    def __init__(self, cell: Optional[TxnCell] = None) -> None:
        super().__init__(cell)
        cell = self._cell
        self._heap: List[Tuple[float, int, int]] = JList(cell)   # (priority, serial, unit)
        self._entry = JDict(cell)       # cached unit -> serial of its live entry
        self._hits = JDict(cell)        # unit -> hits served since its content
        self._generated = JSet(cell)    # units holding generated tokens
        self._clock = 0.0
        self._serial = 0

    def _push(self, entry: tuple) -> None:
        """heapq.heappush; inside a transaction the same algorithm in Python (heapq's own
        _siftdown), whose every write goes through the JList and is logged."""
        heap = self._heap
        if not self._cell.active:
            heapq.heappush(heap, entry)        # (C: writes the list directly, unlogged)
            return
        heap.append(entry)
        heapq._siftdown(heap, 0, len(heap) - 1)

    def _pop(self) -> tuple:
        """heapq.heappop; logged inside a transaction as ``_push``."""
        heap = self._heap
        if not self._cell.active:
            return heapq.heappop(heap)
        last = heap.pop()
        if not heap:
            return last
        top, heap[0] = heap[0], last
        heapq._siftup(heap, 0)
        return top

    def add(self, unit: int, tokens: int) -> None:
        self._weigh(unit, tokens)
        if len(self._heap) > 2 * len(self._entry) + 64:     # drop stale entries now and then
            live = JList(self._cell, (e for e in self._heap if self._entry.get(e[2]) == e[1]))
            heapq.heapify(live)                 # a new list: the old one comes back on rollback
            self._cell.set(self, "_heap", live)
        self._cell.set(self, "_serial", self._serial + 1)
        self._entry[unit] = self._serial
        value = self._hits.get(unit, 0) + (unit not in self._generated)
        self._push((self._clock + value, self._serial, unit))

    def remove(self, unit: int) -> None:
        del self._entry[unit]            # its heap entry is now stale (skipped by pop)
        self._unweigh(unit)

    def note_hit(self, unit: int) -> None:
        self._hits[unit] = self._hits.get(unit, 0) + 1

    def note_generated(self, unit: int) -> None:
        self._generated.add(unit)

    def pop(self) -> int:
        while True:
            priority, serial, unit = self._pop()
            if self._entry.get(unit) == serial:
                break
        del self._entry[unit]
        self._unweigh(unit)
        self.forget(unit)
        self._cell.set(self, "_clock", priority)
        return unit

    def forget(self, unit: int) -> None:
        self._hits.pop(unit, None)
        self._generated.discard(unit)

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, unit: int) -> bool:
        return unit in self._entry

    def __iter__(self) -> Iterator[int]:
        live = sorted((p, s, u) for p, s, u in self._heap if self._entry.get(u) == s)
        return iter([u for _, _, u in live])


_POLICIES = {"off": NoRetention, "lru": EvictionPolicy, "hits": HitsPolicy}


def make_eviction(name: str, cell: Optional[TxnCell] = None) -> EvictionPolicy:
    """The policy called ``name`` (one of ``EVICTION_POLICIES``), else ConfigError; its
    changes log to ``cell``'s open journal (a manager's transactions)."""
    if name not in _POLICIES:
        raise ConfigError(f"prefix_eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                          f"got {name!r}")
    return _POLICIES[name](cell)
