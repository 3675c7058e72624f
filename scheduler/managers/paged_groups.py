"""Block groups of a paged pool: a model's layers split into equal groups of one kind each, every
group with its own block table per sequence over the one pool (vLLM v1's hybrid allocator).

    kinds_of(gemma3 pattern, 6 layers)   full (5,), window-W (0, 1, 2, 3, 4)
    G = gcd(1, 5) = 1 layer per group    groups: (5,) full, (0,) (1,) (2,) (3,) (4,) window-W

    pool  [G, 2 (K,V), num_blocks, block_size, kv_heads, head_dim]
    layer l of group g at position p reads pool[p] through group g's block table

A block holds G layers' K/V of ``block_size`` tokens whatever group takes it, so the groups
share one free list (a ``PageLedger`` whose tenants are the group indexes) and the split
between full and windowed memory follows the load. G is the gcd of the kinds' layer counts,
so no block carries unused layers (vLLM pads its groups to the smallest kind instead). A
model of one kind (every layer full, or every layer the same window) is ONE group of all its
layers: a block of every layer, exactly the single block table it always had.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

from ..presets import ModelSpec
from .kinds import kinds_of
from .prefix import HeldSeq


class BlockGroup(NamedTuple):
    """One block group: the model ``layers`` a block of it holds (ascending) and their sliding
    window in tokens (None: full attention, every block kept)."""
    layers: tuple
    window_tokens: Optional[int]


def block_groups(model: ModelSpec) -> tuple:
    """The model's block groups: one of every layer for a model of one kind, else each kind's
    layers in runs of gcd(layer counts), full kinds first (``kinds_of``'s order)."""
    kinds = kinds_of(model)
    if len(kinds) == 1:
        return (BlockGroup(tuple(range(model.num_layers)), kinds[0].window_tokens),)
    size = math.gcd(*(k.num_layers for k in kinds))
    return tuple(BlockGroup(k.layers[i:i + size], k.window_tokens)
                 for k in kinds for i in range(0, k.num_layers, size))


class PagedSeq(HeldSeq):
    """A paged sequence's record: one block table per group, ``tables[0] is units`` (so what
    UnitOps reads of ``units`` is group 0's table). Every group's table has the same
    length (ceil(num_tokens / block_size)); a windowed group's given-back blocks are a None
    prefix."""

    __slots__ = ("tables",)

    def __init__(self, num_tokens: int, ids: Optional[list], namespace: Optional[str],
                 groups: int = 1) -> None:
        super().__init__(num_tokens, ids, namespace)
        self.tables = [self.units] + [[] for _ in range(groups - 1)]

    def set_tables(self, tables: list) -> None:
        self.tables = tables
        self.units = tables[0]

    def copy(self) -> "PagedSeq":
        c = PagedSeq(self.num_tokens, None if self.ids is None else list(self.ids), self.namespace)
        c.keys, c.reserved, c.slot = list(self.keys), self.reserved, self.slot
        c.published, c.prompt_units = self.published, self.prompt_units
        c.set_tables([list(t) for t in self.tables])
        return c

    def snapshot(self) -> tuple:
        return HeldSeq.snapshot(self), [list(t) for t in self.tables[1:]]

    def restore(self, saved: tuple) -> None:
        HeldSeq.restore(self, saved[0])
        self.tables = [self.units] + saved[1]
