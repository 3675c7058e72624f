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

A hybrid's prefix index (``GroupPrefixIndex``) names each group's blocks apart under the same
verified chain of prefix nodes, so a windowed group's blocks stay findable after the blocks
behind its window are gone, and a block of one group never serves another. Its prefix cache
(``NodeCountedCache``) counts a cached prefix node's tokens once, not once per group.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from ..presets import ModelSpec
from .journal import JDict, TxnCell, journaled
from .kinds import kinds_of
from .prefix import HeldSeq, UnitKey, add_child, discard_child


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


def window_start(hit_blocks: int, group: BlockGroup, block_size: int) -> int:
    """The first block a group reads after a hit of ``hit_blocks`` blocks: 0 for a full group;
    a windowed one's queries from token h*block_size read from h*bs - W + 1 on (the blocks
    before are what ``release_behind_window`` would give back)."""
    if group.window_tokens is None:
        return 0
    return max(hit_blocks * block_size - group.window_tokens + 1, 0) // block_size


class GroupReg(NamedTuple):
    """One registration of a hybrid's index: ``unit`` (a block) of block ``group`` holds the
    K/V of the prefix node ``node`` (a serial of ``GroupPrefixIndex.nodes``)."""
    unit: int
    group: int
    node: int


class PrefixNode(NamedTuple):
    """A verified token prefix: its last whole unit's ``key`` after the prefix ``parent``
    (a serial; None: the first unit)."""
    key: UnitKey
    parent: Optional[int]


class GroupPrefixIndex:
    """A paged hybrid's prefix index: nodes of verified prefixes (chained digests, each node
    keeping its unit's token ids and its parent node, so a colliding digest is a miss), and per
    node at most one block of each block group holding that prefix's last unit.

    A node lives while a block is registered under it or a child node does, so a windowed
    group's block stays verifiable after the blocks before it (every group's) are gone: a
    hit's window blocks are matched through the nodes, never through the blocks behind the
    window. A hit reads each full group's block of every node it passes, so every node holds
    one (``drop``). A block of group A is never found for group B (``blocks`` is keyed by
    group). Every change logs to ``cell``'s open journal."""

    def __init__(self, cell: TxnCell, groups: Sequence[BlockGroup]) -> None:
        self._cell = cell
        self._num_groups = len(groups)
        self._full = frozenset(g for g, group in enumerate(groups) if group.window_tokens is None)
        self.nodes: dict = JDict(cell)       # serial -> PrefixNode
        self.by_digest: dict = JDict(cell)   # digest -> serial
        self.by_unit: dict = JDict(cell)     # block -> GroupReg
        self.blocks: dict = JDict(cell)      # (serial, group) -> block
        self.uses: dict = JDict(cell)        # serial -> registered blocks + child nodes
        self.children: dict = JDict(cell)    # serial -> JSet of its child nodes' serials
        self.serials = 0

    def journaled_fields(self) -> bool:
        return all(journaled(v) for v in vars(self).values())

    def chain(self, keys: Sequence[UnitKey]) -> list:
        """Serials of the nodes of the longest verified prefix of ``keys``."""
        out, parent = [], None
        for key in keys:
            s = self.by_digest.get(key.digest)
            if s is None:
                break
            node = self.nodes[s]
            if node.key.tokens != key.tokens or node.parent != parent:
                break
            out.append(s)
            parent = s
        return out

    def register(self, unit: int, group: int, keys: Sequence[UnitKey], k: int,
                 parent: Optional[int] = -1) -> None:
        """Name block ``unit`` of ``group`` as holding the prefix ``keys[:k + 1]`` (the
        registering sequence's own keys). ``parent``: the node of ``keys[:k]`` when the caller
        knows it (-1: find it). No-op when the unit is named already, the group has a block for
        that prefix, or a digest of the chain names other content."""
        if unit in self.by_unit:
            return
        if parent == -1 or (k == 0) != (parent is None):
            found = self.chain(keys[:k + 1])
            if len(found) == k + 1:
                self._attach(unit, group, found[-1])
                return
            missing = keys[len(found):k + 1]
            if any(key.digest in self.by_digest for key in missing):
                return                     # another prefix holds that digest: cannot verify
            if self._full and (len(missing) > 1 or group not in self._full):
                return                     # a node without full blocks: no hit reaches it
            parent = found[-1] if found else None
            for key in missing:
                parent = self._new_node(key, parent)
            self._attach(unit, group, parent)
            return
        key = keys[k]
        s = self.by_digest.get(key.digest)
        if s is None:
            if self._full and group not in self._full:
                return                     # (as above)
            s = self._new_node(key, parent)
        else:
            node = self.nodes[s]
            if node.key.tokens != key.tokens or node.parent != parent:
                return
        self._attach(unit, group, s)

    def hit_tables(self, keys: Sequence[UnitKey], groups: Sequence[BlockGroup],
                   block_size: int) -> list:
        """A prompt's hit (``keys``: its whole blocks that may hit): [] or one table per group,
        all of the hit's length h (blocks), a windowed group's None up to the first block its
        window reads. h is the longest prefix every full group holds, cut back until each
        windowed group holds its window's blocks before the hit's end (vLLM v1's rule)."""
        nodes = self.chain(keys)
        blocks, h = self.blocks, len(nodes)
        for g, group in enumerate(groups):        # full groups: every block of the hit
            if group.window_tokens is None:
                k = 0
                while k < h and (nodes[k], g) in blocks:
                    k += 1
                h = k
        runs = []      # per windowed group: run[k] = its blocks present in a row up to block k
        for g, group in enumerate(groups):
            if group.window_tokens and h:
                run, n = [], 0
                for k in range(h):
                    n = n + 1 if (nodes[k], g) in blocks else 0
                    run.append(n)
                runs.append((run, group))
        while h and not all(run[h - 1] >= h - window_start(h, group, block_size)
                            for run, group in runs):
            h -= 1                                    # cut back until the windows are there
        if not h:
            return []
        return [[None] * window_start(h, group, block_size)
                + [blocks[(nodes[k], g)] for k in range(window_start(h, group, block_size), h)]
                for g, group in enumerate(groups)]

    def publish(self, seq: PagedSeq, upto: int, note_generated) -> None:
        """Register ``seq``'s blocks from its ``published`` up to block ``upto`` in every group
        (a windowed group's given-back blocks skipped); generated blocks are noted to the
        eviction policy (``note_generated``)."""
        keys = seq.keys
        for k in range(seq.published, upto):
            parent = None if k == 0 else -1
            if k:     # the node of this sequence's block k-1, in any group that still names it
                for table in seq.tables:
                    node = self.node_of(table[k - 1])
                    if node is not None:
                        parent = node
                        break
            for g, table in enumerate(seq.tables):
                b = table[k]
                if b is None:         # given back behind the window
                    continue
                self.register(b, g, keys, k, parent)
                if k >= seq.prompt_units:
                    note_generated(b)
        seq.published = max(seq.published, upto)

    def _new_node(self, key: UnitKey, parent: Optional[int]) -> int:
        self._cell.set(self, "serials", self.serials + 1)
        s = self.serials
        self.nodes[s] = tuple.__new__(PrefixNode, (key, parent))
        self.by_digest[key.digest] = s
        self.uses[s] = 0
        if parent is not None:
            self.uses[parent] += 1
            add_child(self.children, self._cell, parent, s)
        return s

    def _attach(self, unit: int, group: int, s: int) -> None:
        if (s, group) in self.blocks:
            return               # (never a fresh node: it has no block yet)
        self.blocks[(s, group)] = unit
        self.by_unit[unit] = tuple.__new__(GroupReg, (unit, group, s))
        self.uses[s] += 1

    def node_of(self, unit: Optional[int]) -> Optional[int]:
        """The node ``unit`` is registered under (None: not registered)."""
        reg = self.by_unit.get(unit)
        return None if reg is None else reg.node

    def drop(self, unit: int) -> list:
        """Forget ``unit``'s content (nodes left with no block and no child go too); a full
        group's block takes every block at its node and below (no hit reads them again): returns
        those, nearest first. A windowed one goes alone (hits whose window starts past it)."""
        reg = self.by_unit.get(unit)
        if reg is None:
            return []
        self._forget(reg)
        if reg.group not in self._full:
            return []
        below, nodes = [], [reg.node]
        for s in nodes:                      # (grows as it goes: breadth first)
            nodes.extend(sorted(self.children.get(s, ())))   # (before its blocks: may prune it)
            for g in range(self._num_groups):
                b = self.blocks.get((s, g))
                if b is not None:
                    below.append(b)
                    self._forget(self.by_unit[b])
        return below

    def _forget(self, reg: GroupReg) -> None:
        del self.by_unit[reg.unit]
        del self.blocks[(reg.node, reg.group)]
        s: Optional[int] = reg.node
        while s is not None:
            left = self.uses[s] - 1
            if left:
                self.uses[s] = left
                return
            node = self.nodes.pop(s)
            del self.uses[s]
            del self.by_digest[node.key.digest]
            if node.parent is not None:
                discard_child(self.children, node.parent, s)
            s = node.parent

    def check(self) -> None:
        uses: dict = {s: 0 for s in self.nodes}
        for s, node in self.nodes.items():
            assert self.by_digest[node.key.digest] == s, s
            if node.parent is not None:
                uses[node.parent] += 1
        assert len(self.by_digest) == len(self.nodes)
        for (s, group), unit in self.blocks.items():
            assert self.by_unit[unit] == (unit, group, s), unit
            uses[s] += 1
        assert len(self.by_unit) == len(self.blocks)
        assert uses == dict(self.uses) and all(uses.values()), "node uses"
        assert {(node.parent, s) for s, node in self.nodes.items() if node.parent is not None} \
            == {(p, s) for p, kids in self.children.items() for s in kids}, "children"
        assert all(self.children.values()), "an empty child set"
        assert all((s, g) in self.blocks for s in self.nodes for g in self._full), \
            "a node without a full group's block: nothing at or below it can be hit"


def anchor_groups(groups: Sequence[BlockGroup]) -> frozenset:
    """The block groups whose blocks make a prefix node's tokens cached: the full groups (every
    hit reads each of their blocks); a hybrid without full layers, its widest window's."""
    full = frozenset(g for g, group in enumerate(groups) if group.window_tokens is None)
    if full:
        return full
    widest = max(group.window_tokens for group in groups)
    return frozenset(g for g, group in enumerate(groups) if group.window_tokens == widest)


class NodeCountedCache:
    """A paged hybrid's prefix cache: ``policy`` (eviction.py) orders and holds its blocks, and
    ``tokens`` counts a cached prefix ONCE, not once per block group: a node's ``block_size``
    tokens count while the block of every anchor group (``anchor_groups``) registered under it
    is cached, i.e. held by no sequence and findable for a hit. (The policy's own sum counts
    a block of each group: tiny-gemma3's six groups, six times the tokens.) The manager calls
    ``add`` while the block is registered (``remove`` and ``pop`` may come after its
    registration went: ``GroupPrefixIndex.drop``'s blocks below); every other call is the
    policy's. Changes log to ``cell``'s journal."""

    def __init__(self, policy, index: GroupPrefixIndex, groups: Sequence[BlockGroup],
                 block_size_tokens: int, cell: TxnCell) -> None:
        self.policy = policy
        self._index = index
        self._anchors = anchor_groups(groups)
        self._block_tokens = block_size_tokens
        self._cell = cell
        self._anchored: dict = JDict(cell)    # node serial -> its anchor blocks now cached
        self._node_of: dict = JDict(cell)     # cached anchor block -> its node serial
        self.tokens = 0                        # block_size per node with all of them cached

    def journaled_fields(self) -> bool:
        return all(journaled(v) for v in vars(self).values())

    def _count(self, unit: int, step: int) -> None:
        if step > 0:
            reg = self._index.by_unit[unit]
            if reg.group not in self._anchors:
                return
            node = self._node_of[unit] = reg.node
        else:
            node = self._node_of.pop(unit, None)
            if node is None:
                return
        before = self._anchored.get(node, 0)
        after, whole = before + step, len(self._anchors)
        if whole in (before, after):
            self._cell.set(self, "tokens", self.tokens + step * self._block_tokens)
        if after:
            self._anchored[node] = after
        else:
            del self._anchored[node]

    def add(self, unit: int, tokens: int) -> None:
        self.policy.add(unit, tokens)
        self._count(unit, 1)

    def remove(self, unit: int) -> None:
        self._count(unit, -1)
        self.policy.remove(unit)

    def pop(self) -> int:
        unit = self.policy.pop()
        self._count(unit, -1)
        return unit

    @property
    def retains(self) -> bool:
        return self.policy.retains

    def note_hit(self, unit: int) -> None:
        self.policy.note_hit(unit)

    def note_generated(self, unit: int) -> None:
        self.policy.note_generated(unit)

    def forget(self, unit: int) -> None:
        self.policy.forget(unit)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, unit: int) -> bool:
        return unit in self.policy

    def __iter__(self):
        return iter(self.policy)
