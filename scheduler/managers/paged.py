"""Paged manager (the PagedAttention / vLLM approach): fixed blocks of ``block_size`` tokens from
a pool, a block table per sequence, reference counts, copy-on-write and prefix caching.

Every block is in exactly one of three states:

    free     ref 0, unregistered      in ``_free`` (a stack)
    cached   ref 0, registered content in ``_cache`` (the eviction policy, ``prefix_eviction``;
                                       evicted only when _free is empty)
    held     ref >= 1                  in the block tables of ``ref`` resident sequences

Cached blocks count as FREE capacity (as vLLM's kv_cache_usage does): taking one just drops its
registration. A full block is registered in the prefix index only once its K/V are computed
(``mark_computed``, or ``free``: publish on compute), so a hit never reads unwritten memory.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError, OutOfCapacityError, RequestTooLargeError
from ..layout import CacheKind, CacheLayout
from ..presets import ModelSpec
from .base import CopyBlock, MemoryStats
from .common import check_int
from .eviction import DEFAULT_EVICTION
from .prefix import HeldSeq
from .units import UnitManager
from .window import WindowedGroups, dropped_units, held_units


class PagedManager(WindowedGroups, UnitManager):
    """Block-table manager. ``prefix_queries``/``prefix_hits`` count TOKENS (as vLLM's
    prefix-cache metrics do): tokens offered to ``allocate`` with ``token_ids``, and of those the
    tokens served from cached blocks."""

    name = "paged"

    def __init__(self, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 block_size_tokens: int = 16, swap_bytes: int = 0,
                 prefix_eviction: str = DEFAULT_EVICTION) -> None:
        super().__init__(model, max_seq_len_tokens, swap_bytes)
        self.block_size = bs = check_int("block_size_tokens", block_size_tokens, 1)
        self.num_blocks = check_int("cache_bytes", cache_bytes, 1) // (bs * self.bytes_per_token)
        if self.num_blocks < 1:
            raise ConfigError(f"cache_bytes={cache_bytes} holds no block of {bs} tokens; needs "
                              f">= {bs * self.bytes_per_token}")
        self._init_units(self.num_blocks, bs, prefix_eviction)
        self._init_window(model.window_tokens)

    _FIXED_FIELDS = UnitManager._FIXED_FIELDS | {"block_size", "num_blocks", "_window"}

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self.num_blocks * self.block_size)

    def layout(self) -> CacheLayout:
        """A paged cache of this many blocks of this size."""
        return CacheLayout(CacheKind.PAGED, self.max_seq_len, block_size_tokens=self.block_size,
                           num_blocks=self.num_blocks)

    def block_table(self, seq_id: int) -> list:
        """Block ids of a resident sequence, in token order (block k holds tokens
        [k*block_size, (k+1)*block_size)); None for a block given back behind the window."""
        return list(self._seq(seq_id).units)

    def _available_units(self) -> int:
        return len(self._free) + len(self._cache)

    def _take_block(self) -> int:
        """A block for new content: a free one, else the cached one the eviction policy names."""
        b = self._free.pop() if self._free else self._evict()
        self._touch(b)
        self._refs[b] = 1
        self._fill[b] = 0
        return b

    def _unheld(self, b: int) -> None:
        self._free.append(b)

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None) -> int:
        self._check_new(seq_id)
        self._check_length(num_tokens)
        hits = self._hits(num_tokens, token_ids, namespace)
        need = self._need(num_tokens, hits)
        if need > self._available_units():
            raise OutOfCapacityError(f"sequence {seq_id} needs {need} blocks of "
                                     f"{self.block_size} tokens, {self._available_units()} free")
        seq = self._new_seq(num_tokens, token_ids, namespace)
        for b in hits:
            self._hold(b)
        seq.units = list(hits)
        for _ in range(-(-num_tokens // self.block_size) - len(hits)):
            seq.units.append(self._take_block())
        self._fill_blocks(seq, len(hits) * self.block_size, num_tokens)
        self._cap_sum += len(seq.units) * self.block_size
        self._tok_sum += num_tokens
        self._put_seq(seq_id, seq)
        self._register_prompt(seq, hits)
        return self._count_prefix(token_ids, num_tokens, hits)

    def _fill_blocks(self, seq: HeldSeq, start: int, end: int) -> None:
        """Account tokens [start, end) as written into ``seq``'s blocks (all private)."""
        bs, pos = self.block_size, start
        while pos < end:
            k = pos // bs
            stop = min(end, (k + 1) * bs)
            self._touch(seq.units[k])
            self._fill[seq.units[k]] += stop - pos
            pos = stop
        self._live += end - start

    # -- growth --
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        new = seq.num_tokens + num_tokens
        if (seq.units and new <= len(seq.units) * self.block_size and new <= self.max_seq_len
                and self._refs[seq.units[-1]] == 1):
            return True      # hot path: room in a private last block
        return new <= self.max_seq_len and self._growth(seq, num_tokens) <= self._available_units()

    def _append_slow(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        self._check_append_ids(num_tokens, token_ids)
        old, bs = seq.num_tokens, self.block_size
        if old + num_tokens > self.max_seq_len:
            raise RequestTooLargeError(f"sequence {seq_id} would grow to {old + num_tokens} "
                                       f"tokens, over max_seq_len {self.max_seq_len}")
        need = self._growth(seq, num_tokens)
        if need > self._available_units():
            raise OutOfCapacityError(f"appending {num_tokens} tokens to sequence {seq_id} needs "
                                     f"{need} blocks, {self._available_units()} free")
        if num_tokens == 0:
            return
        if old % bs and self._refs[seq.units[-1]] > 1:     # copy-on-write, the writer moves
            src = seq.units[-1]
            dst = self._take_block()
            self._fill[dst] = self._fill[src]
            self._live += self._fill[src]
            self._unhold(src)
            seq.units[-1] = dst
            self._ops.append(CopyBlock(src, dst, owner=seq_id))
        before = len(seq.units)
        for _ in range(-(-(old + num_tokens) // bs) - before):
            seq.units.append(self._take_block())
        self._cap_sum += (len(seq.units) - before) * bs
        end = old + num_tokens
        self._fill_blocks(seq, old, end)
        self._tok_sum += num_tokens
        seq.num_tokens = end
        seq.note_ids(old, token_ids)
        if end // bs > old // bs:
            seq.new_full_keys(bs, self.model.kv_encoding)

    # -- fork and release --
    def can_fork(self, parent_id: int) -> bool:
        self._seq(parent_id)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        self._check_new(child_id)
        child = parent.copy()
        for b in held_units(child):
            self._hold(b)
        self._put_seq(child_id, child)
        self._cap_sum += len(held_units(child)) * self.block_size
        self._tok_sum += child.num_tokens - dropped_units(child) * self.block_size

    def _swap_location(self, seq: HeldSeq) -> dict:
        return {"blocks": tuple(seq.units)}

    def _release(self, seq: HeldSeq) -> None:
        held = held_units(seq)
        for b in reversed(held):        # tail blocks first in LRU: evicted before the prefix
            self._unhold(b)
        self._cap_sum -= len(held) * self.block_size
        self._tok_sum -= seq.num_tokens - (len(seq.units) - len(held)) * self.block_size
        seq.units = []

    # -- swap hooks --
    def _fresh_units(self, seq: HeldSeq) -> Optional[int]:
        return -(-seq.num_tokens // self.block_size)

    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        n = seq.num_tokens
        seq.units = [self._take_block() for _ in range(-(-n // self.block_size))]
        self._fill_blocks(seq, 0, n)
        self._cap_sum += len(seq.units) * self.block_size
        self._tok_sum += n
        self._republish(seq)

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(f"{what}: {self._available_units()} blocks of "
                                 f"{self.block_size} tokens free")

    # -- queries --
    def stats(self) -> MemoryStats:
        free = self._available_units() * self.block_size
        total = self.num_blocks * self.block_size
        return MemoryStats(total_tokens=total, allocated_tokens=total - free,
                           live_tokens=self._live, free_tokens=free,
                           end_waste_tokens=self._cap_sum - self._tok_sum,
                           bytes_per_token=self.bytes_per_token)

    def check_integrity(self) -> None:
        bs, refs = self.block_size, [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.units) == -(-seq.num_tokens // bs), "block table length"
            gone = dropped_units(seq)
            assert None not in seq.units[gone:], "given back past the window's start"
            for k, b in enumerate(seq.units[gone:], start=gone):
                refs[b] += 1
                assert self._fill[b] == min(bs, seq.num_tokens - k * bs), ("fill", b)
        assert refs == self._refs, "reference counts"
        free, cached = set(self._free), set(self._cache)
        assert len(free) == len(self._free) and not free & cached
        assert all(refs[b] == 0 and b not in self.prefix.by_unit for b in free)
        assert all(refs[b] == 0 and b in self.prefix.by_unit for b in cached)
        held = sum(1 for r in refs if r)
        assert held + len(free) + len(cached) == self.num_blocks, "free + held == total"
        assert len(cached) == len(self._cache)
        assert all(refs[b] or b in cached for b in self.prefix.by_unit), "registered: held or cached"
        assert self._live == sum(self._fill[b] for b in range(self.num_blocks) if refs[b])
        assert self._cap_sum == sum(len(held_units(s)) * bs for s in self._seqs.values())
        assert self._tok_sum == sum(s.num_tokens - dropped_units(s) * bs for s in self._seqs.values())
        self.prefix.check()
        self._swap_integrity()
