"""Prefix sharing by chain hash, shared by the paged and vmem managers.

A *unit* is a paged block or a vmem page group; ``unit_tokens`` is how many tokens it holds.
Only FULL units are hashed. The hash of unit k chains the hash of unit k-1, so equal hashes mean
equal whole prefixes, not just equal blocks; the namespace (an adapter id, say) is part of every
hash, so units computed under different weights never match:

    h0 = H(None, ids[0:U],  ns)   h1 = H(h0, ids[U:2U], ns)   h2 = H(h1, ids[2U:3U], ns) ...

H is Python's tuple hash (64-bit, process-local), as vLLM's builtin-hash option.
"""
from __future__ import annotations

from typing import Optional, Sequence


def unit_hash(prev: Optional[int], tokens: Sequence[int], namespace: Optional[str]) -> int:
    """Chain hash of one full unit: its predecessor's hash, its token ids and the namespace."""
    return hash((prev, tuple(tokens), namespace))


def prefix_hashes(token_ids: Sequence[int], unit_tokens: int, num_tokens: int,
                  namespace: Optional[str]) -> list:
    """Chain hashes of the full units a new sequence of ``num_tokens`` may take from the cache.

    Only units inside the first ``num_tokens - 1`` tokens are eligible, so a hit never covers
    the last token: the caller always computes at least one token (whose logits it needs) and
    never writes into a shared unit.
    """
    limit = min(num_tokens - 1, len(token_ids)) // unit_tokens
    hashes, prev = [], None
    for k in range(limit):
        prev = unit_hash(prev, token_ids[k * unit_tokens:(k + 1) * unit_tokens], namespace)
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """hash <-> unit maps of the units whose content is known (full and never written since).

    Guarantees: a unit has at most one hash and a hash names at most one unit; ``drop`` of a
    unit without a hash is a no-op (so callers may drop on every reuse).
    """

    def __init__(self) -> None:
        self.unit_of: dict = {}   # hash -> unit
        self.hash_of: dict = {}   # unit -> hash

    def match(self, hashes: Sequence[int]) -> list:
        """Units of the longest cached prefix of ``hashes``."""
        units = []
        for h in hashes:
            u = self.unit_of.get(h)
            if u is None:
                break
            units.append(u)
        return units

    def register(self, unit: int, h: int) -> None:
        """Name ``unit`` by ``h`` unless another unit already holds that content."""
        if h not in self.unit_of and unit not in self.hash_of:
            self.unit_of[h] = unit
            self.hash_of[unit] = h

    def drop(self, unit: int) -> None:
        """Forget ``unit``'s content (it is about to be overwritten)."""
        h = self.hash_of.pop(unit, None)
        if h is not None:
            del self.unit_of[h]

    def check(self) -> None:
        assert len(self.unit_of) == len(self.hash_of)
        for h, u in self.unit_of.items():
            assert self.hash_of[u] == h, (h, u)


class SeqState:
    """One sequence's bookkeeping, shared by all managers (mutable, slotted: no per-step
    allocation). ``units`` is the block table (paged) or page-index -> group list (vmem)."""

    __slots__ = ("num_tokens", "units", "ids", "namespace", "hashes", "reserved", "slot")

    def __init__(self, num_tokens: int, ids: Optional[list], namespace: Optional[str]) -> None:
        self.num_tokens = num_tokens   # live tokens
        self.units: list = []          # block ids / group ids, index = unit index
        self.ids = ids                 # known token ids (may run ahead of num_tokens); None: unknown
        self.namespace = namespace
        self.hashes: list = []         # chain hashes of units 0..len-1 (all full)
        self.reserved = 0              # reserve managers: tokens held
        self.slot = -1                 # vmem: batch row

    def copy(self) -> "SeqState":
        c = SeqState(self.num_tokens, None if self.ids is None else list(self.ids), self.namespace)
        c.units, c.hashes, c.reserved, c.slot = list(self.units), list(self.hashes), self.reserved, self.slot
        return c

    def note_ids(self, old_tokens: int, token_ids: Optional[Sequence[int]]) -> None:
        """Record the ids of tokens appended after ``old_tokens``; forget all ids once a gap
        appears (later units then can never be hashed)."""
        ids = self.ids
        if ids is None:
            return
        if len(ids) == old_tokens and token_ids is not None:
            ids.extend(token_ids)
        elif len(ids) < self.num_tokens:
            self.ids = None

    def new_full_hashes(self, unit_tokens: int) -> list:
        """Hash every unit that became full since the last call: [(unit_index, hash)]."""
        out = []
        ids, hashes = self.ids, self.hashes
        if ids is None:
            return out
        k = len(hashes)
        while (k + 1) * unit_tokens <= self.num_tokens and (k + 1) * unit_tokens <= len(ids):
            h = unit_hash(hashes[-1] if hashes else None, ids[k * unit_tokens:(k + 1) * unit_tokens],
                          self.namespace)
            hashes.append(h)
            out.append((k, h))
            k += 1
        if (k + 1) * unit_tokens <= self.num_tokens:   # a full unit whose ids are unknown
            self.ids = None
        return out
