"""Paged manager (the PagedAttention / vLLM approach): fixed blocks of ``block_size`` tokens from
a pool, a block table per sequence, reference counts, copy-on-write and prefix caching.

Every block is in exactly one of three states:

    free     ref 0, unregistered      free in ``_ledger`` (a PageLedger: its free stack, the
                                       group table holding each taken block)
    cached   ref 0, registered content in ``_cache`` (the eviction policy, ``prefix_eviction``;
                                       evicted only when _free is empty)
    held     ref >= 1                  in the block tables of ``ref`` resident sequences

Cached blocks count as FREE capacity (as vLLM's kv_cache_usage does): taking one just drops its
registration. A full block is registered in the prefix index only once its K/V are computed
(``mark_computed``, or ``free``: publish on compute), so a hit never reads unwritten memory.

Hybrid models (full layers beside windowed ones) have one block table per block group
(paged_groups.py: a block holds G layers of one group; vLLM v1's hybrid allocator). Every
group's table has one entry per block_size tokens; a windowed group gives back its blocks
wholly behind its window (a None prefix), full groups keep theirs. Tokens in ``stats`` are
group tokens (``bytes_per_token`` is one group's); ``cached_tokens`` counts a cached prefix
once, not once per group (``NodeCountedCache``). Prefix hits are whole blocks, exact, by vLLM
v1's hybrid rule (``GroupPrefixIndex.hit_tables``). A hybrid sequence swaps every group's
blocks, group after group, until a windowed group gave blocks back (then ``WindowSwapError``:
preempt by recompute, as vmem does).
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError, OutOfCapacityError
from ..layout import CacheKind, CacheLayout
from ..presets import ModelSpec
from .base import CopyBlock, MemoryStats
from .adapters import AdapterTenancy, adapter_budget_units
from .common import ManagerCore, check_int
from .eviction import DEFAULT_EVICTION
from .ledger import PageLedger
from .paged_groups import GroupPrefixIndex, NodeCountedCache, PagedSeq, block_groups
from .prefix import HeldSeq
from .units import UnitOps
from .integrity import check_paged, idle_paged
from .window import dropped_in


class PagedManager(AdapterTenancy, UnitOps, ManagerCore):
    """Block-table manager. ``prefix_queries``/``prefix_hits`` count TOKENS (as vLLM's
    prefix-cache metrics do): tokens offered to ``allocate`` with ``token_ids``, and of those the
    tokens served from cached blocks."""

    name = "paged"

    def __init__(self, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 block_size_tokens: int = 16, swap_bytes: int = 0,
                 prefix_eviction: str = DEFAULT_EVICTION,
                 adapter_budget_bytes: Optional[int] = None) -> None:
        """``adapter_budget_bytes`` (None: LoRA adapters take blocks of the KV budget): a
        static split, adapters in that many bytes' blocks of their own, KV in the rest of
        ``cache_bytes`` (adapters.py)."""
        super().__init__(model, max_seq_len_tokens, swap_bytes)
        self.block_size = bs = check_int("block_size_tokens", block_size_tokens, 1)
        self.groups = block_groups(model)
        self.block_bytes = bs * 2 * len(self.groups[0].layers) * model.layer_bytes_per_token
        self.adapter_budget_bytes = adapter_budget_bytes
        budget_units = adapter_budget_units(adapter_budget_bytes, self.block_bytes,
                                            check_int("cache_bytes", cache_bytes, 1), "block")
        if budget_units is not None:
            cache_bytes -= adapter_budget_bytes      # KV's part; the total stays the same
        self.num_blocks = cache_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ConfigError(f"cache_bytes={cache_bytes} holds no block of {bs} tokens; needs "
                              f">= {self.block_bytes}")
        self._init_units(self.num_blocks, bs, prefix_eviction, free_list=False)
        self._ledger = PageLedger(self._cell, self.num_blocks)   # tenant: the group index
        self._hybrid = len(self.groups) > 1
        self._plain_append = not self._hybrid     # (UnitOps: one table, counters-only append)
        if self._hybrid:      # each group's blocks registered apart (paged_groups.py)
            self.prefix = GroupPrefixIndex(self._cell, self.groups)   # a prefix counted once
            self._cache = NodeCountedCache(self._cache, self.prefix, self.groups, bs, self._cell)
        windows = [g.window_tokens for g in self.groups if g.window_tokens]
        self._init_window(max(windows) if windows else None)
        self._init_adapters(self._ledger, self.block_bytes, budget_units, self.num_blocks, "block")

    _FIXED_FIELDS = UnitOps._FIXED_FIELDS | AdapterTenancy._ADAPTER_FIXED | {
        "block_size", "num_blocks", "_window", "groups", "block_bytes", "_hybrid", "_plain_append"}
    _SAVED_FIELDS = UnitOps._SAVED_FIELDS + AdapterTenancy._ADAPTER_SAVED
    _JOURNALED_FIELDS = (UnitOps._JOURNALED_FIELDS - {"_free"}) | \
        AdapterTenancy._ADAPTER_JOURNALED | {"_ledger"}

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self._tokens_in_units(self.num_blocks))

    def _tokens_in_units(self, blocks: int) -> int:
        return blocks // len(self.groups) * self.block_size

    def _kv_capacity_units(self, cache_bytes: Optional[int] = None) -> int:
        return self.num_blocks          # one size: the block pool never resizes

    def _kv_ledger(self):
        return self._ledger

    def _free_one(self) -> bool:
        """One more block free for ``_gather``: a cached one in eviction order, else an idle
        adapter's; False when nothing is left."""
        if not len(self._cache):
            return self._evict_adapter_for_kv()
        block = self._evict()
        self._cache.forget(block)
        self._unheld(block)
        return True

    def copied_bytes(self, ops: list) -> int:
        """A ``CopyBlock`` moves one block of its block group's layers."""
        return sum(self.block_bytes for op in ops if type(op) is CopyBlock)

    def layout(self) -> CacheLayout:
        """A paged cache of this many blocks of this size (hybrids: and its block groups)."""
        groups = tuple(g.layers for g in self.groups) if self._hybrid else ()
        return CacheLayout(CacheKind.PAGED, self.max_seq_len, block_size_tokens=self.block_size,
                           num_blocks=self.num_blocks, block_groups=groups,
                           adapter_pool_pages=0 if self._adapters_share_kv
                           else self._adapter_ledger.num_pages)

    def block_table(self, seq_id: int) -> list:
        """Block ids of a resident sequence, in token order (block k holds tokens
        [k*block_size, (k+1)*block_size)); None for a block given back behind the window.
        A hybrid's: its group 0's table (``block_tables``: every group's)."""
        return list(self._seq(seq_id).units)

    def block_tables(self, seq_id: int) -> list:
        """One block table per block group (``groups``), as ``block_table``."""
        return [list(t) for t in self._tables(self._seq(seq_id))]

    def _tables(self, seq: HeldSeq) -> list:
        return seq.tables if self._hybrid else [seq.units]

    def _unit_ids(self, seq: HeldSeq):
        return [b for table in self._tables(seq) for b in table]

    def _new_seq(self, num_tokens: int, token_ids, namespace) -> HeldSeq:
        if not self._hybrid:
            return ManagerCore._new_seq(num_tokens, token_ids, namespace)
        return PagedSeq(num_tokens, None if token_ids is None else list(token_ids), namespace,
                        len(self.groups))

    def _available_units(self) -> int:
        return self._ledger.free_pages + len(self._cache) + self._kv_idle_adapter_pages

    def _take_block(self, group: int = 0) -> int:
        """A block for new content: a free one, else the cached one the eviction policy names,
        else one an idle adapter gives back (room was counted)."""
        if not self._ledger.free_pages and not len(self._cache):
            if not self._evict_adapter_for_kv():
                raise AssertionError("no block left to free: room was miscounted")   # a bug
        if self._ledger.free_pages:
            b = self._ledger.take_one(group)
        else:
            b = self._evict()
            if self._ledger.holder(b) != group:     # a hybrid's cached block of another group
                self._ledger.give_one(b)
                b = self._ledger.take_one(group)  # (the one just given: top of the stack)
        self._touch(b)
        self._refs[b] = 1
        self._fill[b] = 0
        return b

    def _take_blocks(self, seq: HeldSeq, count: int) -> None:
        """``count`` new blocks at the end of every table of ``seq``."""
        for g, table in enumerate(self._tables(seq)):
            for _ in range(count):
                table.append(self._take_block(g))

    def _unheld(self, b: int) -> None:
        self._ledger.give_one(b)

    # -- hybrids: per-group prefix hits (paged_groups.py) --
    def _hits(self, num_tokens: int, token_ids, namespace, share_from=None) -> list:
        """Non-hybrid: UnitOps'. A hybrid's: [] or one hit table per group, all of the hit's
        length h (blocks), a windowed group's None up to the first block its window reads
        (a sibling's: every group's blocks, none given back)."""
        if not self._hybrid:
            return super()._hits(num_tokens, token_ids, namespace, share_from)
        if share_from is not None:
            sibling, tokens = share_from
            k = min(tokens, num_tokens - 1) // self.block_size
            tables = [t[:k] for t in self._seq(sibling).tables]
            return tables if k and all(None not in t for t in tables) else []
        if token_ids is None:
            return []
        limit = min(num_tokens - 1, len(token_ids)) // self.block_size
        keys = self._prompt_keys(token_ids, namespace)[:max(limit, 0)]
        return self.prefix.hit_tables(keys, self.groups, self.block_size)

    def _need(self, num_tokens: int, hits: list) -> int:
        if not self._hybrid:
            return super()._need(num_tokens, hits)
        blocks = -(-num_tokens // self.block_size)
        if not hits:
            return blocks * len(self.groups)
        revived = sum(1 for t in hits for b in t if b is not None and self._refs[b] == 0)
        return (blocks - len(hits[0])) * len(self.groups) + revived

    def _fresh_units(self, seq: HeldSeq, extra_tokens: int = 0) -> Optional[int]:
        return -(-(seq.num_tokens + extra_tokens) // self.block_size) * len(self.groups)

    def _publish(self, seq: HeldSeq, computed_tokens: int) -> None:
        if not self._hybrid:
            return super()._publish(seq, computed_tokens)
        upto = min(computed_tokens // self.block_size, len(seq.keys), len(seq.units))
        self.prefix.publish(seq, upto, self._cache.note_generated)

    def _reached(self, seq: HeldSeq) -> list:
        if not self._hybrid:
            return super()._reached(seq)
        blocks = self.prefix.blocks      # every group's block at each node of its chain
        return [blocks[(s, g)] for s in self.prefix.chain(seq.keys[:seq.published])
                for g in range(len(self.groups)) if (s, g) in blocks]

    def _windowed_tables(self, seq: HeldSeq) -> tuple:
        if not self._hybrid:
            return super()._windowed_tables(seq)
        return tuple((t, g.window_tokens) for t, g in zip(seq.tables, self.groups)
                     if g.window_tokens)

    def _window_dropped(self, seq: HeldSeq) -> int:
        return max(dropped_in(t) for t in self._tables(seq))

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None,
                 share_from: Optional[tuple] = None, lookup: bool = True) -> int:
        self._check_new(seq_id)
        self._check_length(num_tokens)
        hits = self._hits(num_tokens, token_ids if lookup else None, namespace, share_from)
        need = self._need(num_tokens, hits)
        if need > self._available_units():
            raise OutOfCapacityError(f"sequence {seq_id} needs {need} blocks of "
                                     f"{self.block_size} tokens, {self._available_units()} free")
        seq = self._new_seq(num_tokens, token_ids, namespace)
        bs = self.block_size
        if self._hybrid:
            hit_tables, hits = hits, [b for t in hits for b in t if b is not None]
            for g, table in enumerate(seq.tables):
                for b in hit_tables[g] if hit_tables else ():
                    if b is not None:
                        self._hold(b)
                    table.append(b)
            hit_blocks = len(seq.units)
        else:
            for b in hits:
                self._hold(b)
            seq.units.extend(hits)
            hit_blocks = len(hits)
        self._take_blocks(seq, -(-num_tokens // bs) - hit_blocks)
        self._fill_blocks(seq, hit_blocks * bs, num_tokens)
        for units in self._tables(seq):
            gone = dropped_in(units)
            self._cap_sum += (len(units) - gone) * bs
            self._tok_sum += num_tokens - gone * bs
        self._put_seq(seq_id, seq)
        self._register_prompt(seq, hits)
        seq.published = hit_blocks        # (a hybrid's hits: every group's blocks)
        if token_ids is not None and lookup:      # (no lookup: no query counted)
            self.prefix_queries += num_tokens
            self.prefix_hits += hit_blocks * bs
        return hit_blocks * bs

    def _fill_blocks(self, seq: HeldSeq, start: int, end: int) -> None:
        """Account tokens [start, end) as written into ``seq``'s blocks (all private)."""
        tables = self._tables(seq)
        for units in tables:
            self._fill_units(units, start, end)
        self._live += (end - start) * len(tables)

    def _append_in_place(self, seq: HeldSeq, num_tokens: int) -> None:
        if not self._hybrid:
            return super()._append_in_place(seq, num_tokens)
        for units in seq.tables:
            self._touch(units[-1])
            self._fill[units[-1]] += num_tokens
        n = len(self.groups)
        self._live += num_tokens * n
        self._tok_sum += num_tokens * n
        seq.num_tokens += num_tokens

    def _growth(self, seq: HeldSeq, num_tokens: int) -> int:
        if not self._hybrid:
            return super()._growth(seq, num_tokens)
        n, bs = seq.num_tokens, self.block_size
        need = (-(-(n + num_tokens) // bs) - len(seq.units)) * len(self.groups)
        if n % bs and num_tokens:
            need += sum(1 for t in seq.tables if self._refs[t[-1]] > 1)
        return need

    # -- growth --
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        new = seq.num_tokens + num_tokens
        if (seq.units and new <= len(seq.units) * self.block_size and new <= self.max_seq_len
                and all(self._refs[t[-1]] == 1 for t in self._tables(seq))):
            return True      # hot path: room in a private last block
        return new <= self.max_seq_len and self._growth(seq, num_tokens) <= self._available_units()

    def _units_text(self, units: int) -> str:
        return f"{units} blocks"

    def _grow(self, seq_id: int, seq: HeldSeq, old: int, end: int) -> None:
        bs, tables = self.block_size, self._tables(seq)
        for g, units in enumerate(tables):
            if old % bs and self._refs[units[-1]] > 1:     # copy-on-write, the writer moves
                src = units[-1]
                dst = self._take_block(g)
                self._fill[dst] = self._fill[src]
                self._live += self._fill[src]
                self._unhold(src)
                units[-1] = dst
                self._ops.append(CopyBlock(src, dst, owner=seq_id))
        before = len(seq.units)
        self._take_blocks(seq, -(-end // bs) - before)
        self._cap_sum += (len(seq.units) - before) * bs * len(tables)
        self._fill_blocks(seq, old, end)
        self._tok_sum += (end - old) * len(tables)

    # -- fork and release --
    def can_fork(self, parent_id: int) -> bool:
        self._seq(parent_id)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        self._check_new(child_id)
        child = parent.copy()
        bs = self.block_size
        for units in self._tables(child):
            gone = dropped_in(units)
            for b in units[gone:]:
                self._hold(b)
            self._cap_sum += (len(units) - gone) * bs
            self._tok_sum += child.num_tokens - gone * bs
        self._put_seq(child_id, child)

    def _swap_location(self, seq: HeldSeq) -> dict:
        """Every group's table, group after group (the cache splits them evenly)."""
        return {"blocks": tuple(b for table in self._tables(seq) for b in table)}

    def _release(self, seq: HeldSeq) -> None:
        bs, tables = self.block_size, self._tables(seq)
        # tail first in the LRU (evicted before the prefix): block k of every group before any
        # block k-1, so a hybrid's prefix outlives every group's tail (not group after group)
        for k in range(max(map(len, tables), default=0) - 1, -1, -1):
            for units in tables:
                if k < len(units) and units[k] is not None:
                    self._unhold(units[k])
        for units in tables:
            gone = dropped_in(units)
            self._cap_sum -= (len(units) - gone) * bs
            self._tok_sum -= seq.num_tokens - gone * bs
        if self._hybrid:
            seq.set_tables([[] for _ in self.groups])
        else:
            seq.units = []

    # -- swap hooks --
    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        n, count = seq.num_tokens, -(-seq.num_tokens // self.block_size)
        tables = [[self._take_block(g) for _ in range(count)] for g in range(len(self.groups))]
        if self._hybrid:
            seq.set_tables(tables)
        else:
            seq.units = tables[0]
        self._fill_blocks(seq, 0, n)
        self._cap_sum += count * self.block_size * len(tables)
        self._tok_sum += n * len(tables)
        self._republish(seq)

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(f"{what}: {self._available_units()} blocks of "
                                 f"{self.block_size} tokens free")

    # -- queries --
    def stats(self) -> MemoryStats:
        free = (self._ledger.free_pages + len(self._cache)) * self.block_size
        total = self.num_blocks * self.block_size
        return MemoryStats(total_tokens=total, allocated_tokens=total - free,
                           live_tokens=self._live, free_tokens=free,
                           end_waste_tokens=self._cap_sum - self._tok_sum,
                           bytes_per_token=self.block_bytes // self.block_size)

    def kv_cache_usage(self) -> float:
        """Held blocks over the cache: free, cached and idle adapters' blocks count as free
        (KV takes them when it needs them), pinned adapters' as held (as vmem counts pages)."""
        return 1 - self._available_units() / max(self.num_blocks, 1)

    def check_integrity(self) -> None:
        check_paged(self)

    def _check_idle_memory(self) -> None:
        idle_paged(self)
