"""PagedKVCache: K/V in fixed-size blocks of a preallocated pool, named by per-request tables.

    pools  [G, 2 (K,V), num_blocks, block_size, kv_heads, head_dim]   one tensor
    token t of a request lives at block_table[t // block_size], offset t % block_size

G is every layer (one block table per sequence), or for a hybrid the size of its block groups
(``CacheLayout.block_groups``): layer l of group g at position p reads ``pools[p]`` through
group g's table, so each layer view carries its group's table. The block tables are the
cache's replica of what plans told it (EditBlocks: keep a prefix, append blocks, in one group's
table); it never asks a manager.

LoRA adapters (cache/adapters.py): a LoadAdapter's blocks are the adapter's share of the block
budget (their part of ``pools`` stays unused while it is resident); its bytes live in a uint8
buffer of their own on the pools' device, made at load and dropped at evict
(``adapter_buffer``). ``adapter_blocks`` (a static split): block ids ``num_blocks`` on, for
adapters only.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vmemkv.runtime.attention.views import PagedLayerView, StepMeta, window_starts
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.plan import (CopyBlock, DropSwapped, EditBlocks, EvictAdapter, LoadAdapter,
                                   SwapIn, SwapOut)

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError
from ..memory import check_fits_device
from .adapters import ADAPTER_OPS, AdapterReplica
from .base import KVCache, StepBatch
from .journal import PlanJournal


class PagedKVCache(AdapterReplica, KVCache):
    """Executes paged plans on a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    kind = CacheKind.PAGED

    def __init__(self, config: CacheConfig, block_size: int, num_blocks: int,
                 block_groups: tuple = (), adapter_blocks: int = 0) -> None:
        super().__init__(config)
        for name, value, low in (("block_size", block_size, 1), ("num_blocks", num_blocks, 1),
                                 ("adapter_blocks", adapter_blocks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CacheConfigError(f"PagedKVCache {name} must be an int >= {low}, got "
                                       f"{value!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = config
        self.groups = tuple(tuple(g) for g in block_groups) or (tuple(range(c.num_layers)),)
        if sorted(l for g in self.groups for l in g) != list(range(c.num_layers)) or len(
                {len(g) for g in self.groups}) != 1:
            raise CacheConfigError(f"PagedKVCache block_groups must split layers 0.."
                                   f"{c.num_layers - 1} into equal groups, got {block_groups!r}")
        self._where = {l: (g, p) for g, group in enumerate(self.groups) for p, l in enumerate(group)}
        size = len(self.groups[0])
        check_fits_device(f"PagedKVCache pool of {self.num_blocks} blocks of {self.block_size} tokens",
                          self.num_blocks * self.block_size * c.bytes_per_token * size // c.num_layers,
                          c.torch_device)
        self.pools = torch.zeros((size, 2, self.num_blocks, self.block_size,
                                  c.num_kv_heads, c.head_dim), dtype=c.storage_dtype,
                                 device=c.torch_device)
        self.adapter_blocks = adapter_blocks
        block_bytes = self.pools[:, :, 0].numel() * self.pools.element_size()
        self._init_adapters(block_bytes, num_blocks + adapter_blocks)
        self._adapter_buffers: dict = {}   # adapter_id -> uint8 tensor (applied plans)

    def execute(self, ops: Sequence) -> None:
        """Apply the plan, all or nothing: on a failure (an OOM in a copy, say) the blocks it
        overwrote get their bytes back, the swap space is as before, and PlanExecutionError is
        raised."""
        self._check_usable()
        for index, op in enumerate(ops):    # refuse a plan we cannot run before touching memory
            if not isinstance(op, (CopyBlock, SwapOut, SwapIn, DropSwapped) + ADAPTER_OPS):
                raise CacheStateError(f"PagedKVCache cannot execute op {index} of the plan: {op!r}")
        journal = PlanJournal({})
        if any(isinstance(op, ADAPTER_OPS) for op in ops):
            self._bind_adapters(ops, journal)      # checked against the replica, or refused
        try:
            bound = self._bind_swaps(ops)
        except BaseException:
            for undo in reversed(journal.replica_undo):
                undo()
            raise
        if not bound:
            return
        self._step = None   # the plan may move the step's blocks: its writes need a new step
        journal.swapped_before = self._swapped_before
        try:
            for index, (op, buffer) in enumerate(bound):
                journal.op_index = index
                self._apply(op, buffer, journal)
        except Exception as error:
            raise self._fail_plan(journal, error) from error
        except BaseException:
            self._fail_plan(journal, RuntimeError("interrupted"))
            raise

    def _bind_adapters(self, ops: Sequence, journal: PlanJournal) -> None:
        """Every adapter op checked and applied to the replica in plan order (undo in the
        journal); CacheStateError naming the op, the replica as before, otherwise."""
        undo = journal.replica_undo.append
        for index, op in enumerate(ops):
            if isinstance(op, ADAPTER_OPS):
                try:
                    self._bind_adapter(op, undo)
                except CacheStateError as error:
                    for action in reversed(journal.replica_undo):
                        action()
                    raise CacheStateError(f"plan refused at op {index}, nothing changed: "
                                          f"{error}") from None

    def adapter_buffer(self, adapter_id: str) -> torch.Tensor:
        """The ``num_bytes`` of resident adapter ``adapter_id``: its own 1-D uint8 buffer on
        the pools' device. CacheStateError if not resident."""
        self._check_usable()
        self._adapter_entry(adapter_id)
        return self._adapter_buffers[adapter_id]

    def check_integrity(self) -> None:
        super().check_integrity()
        self._check_adapter_replica()
        assert set(self._adapter_buffers) == set(self._adapters), "adapter buffers"
        for adapter_id, (_, num_bytes) in self._adapters.items():
            buffer = self._adapter_buffers[adapter_id]
            assert buffer.dtype == torch.uint8 and buffer.shape == (num_bytes,), adapter_id

    def _apply(self, op, buffer, journal: PlanJournal) -> None:
        if isinstance(op, LoadAdapter):
            buffers = self._adapter_buffers   # new memory beside the block pool: checked
            check_fits_device(f"LoRA adapter {op.adapter_id[:12]}", op.num_bytes,
                              self.pools.device)
            buffers[op.adapter_id] = torch.zeros(op.num_bytes, dtype=torch.uint8,
                                                 device=self.pools.device)
            journal.add(lambda name=op.adapter_id: buffers.pop(name, None))
        elif isinstance(op, EvictAdapter):
            buffers = self._adapter_buffers
            dropped = buffers.pop(op.adapter_id)
            journal.add(lambda name=op.adapter_id, kept=dropped: buffers.__setitem__(name, kept))
        elif isinstance(op, CopyBlock):
            self._save_blocks(journal, [op.dst_block])
            self.pools[:, :, op.dst_block].copy_(self.pools[:, :, op.src_block])
        elif isinstance(op, SwapOut):
            self._tokens_of(op.blocks, op.num_tokens, out=buffer)
        elif isinstance(op, SwapIn):
            self._save_blocks(journal, op.blocks)
            self._store_tokens(op.blocks, buffer)

    def _save_blocks(self, journal: PlanJournal, blocks: Sequence[int]) -> None:
        """Keep the bytes of blocks about to be overwritten; undo writes them back."""
        index = torch.tensor(list(blocks), dtype=torch.int64, device=self.pools.device)
        saved = self.pools.index_select(2, index)
        journal.add(lambda: _bits(self.pools).index_copy_(2, index, _bits(saved)))

    def _flat_index(self, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Flat token index into a [num_blocks * block_size] view for tokens 0..num_tokens-1."""
        positions = torch.arange(num_tokens, device=self.pools.device)
        table = torch.tensor(list(blocks), dtype=torch.int64, device=self.pools.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _flat_pools(self) -> torch.Tensor:
        c = self.config
        # (G, 2, num_blocks * block_size, kv_heads, head_dim)
        return self.pools.view(self.pools.shape[0], 2, self.num_blocks * self.block_size,
                               c.num_kv_heads, c.head_dim)

    def _by_group(self, blocks) -> list:
        """A swap op's ``blocks`` (every group's table, group after group) as (layers, blocks)."""
        per = len(blocks) // len(self.groups)
        return [(torch.tensor(layers, device=self.pools.device), blocks[g * per:(g + 1) * per])
                for g, layers in enumerate(self.groups)]

    def _tokens_of(self, blocks, num_tokens: int, out: torch.Tensor) -> None:
        if len(self.groups) == 1:
            self._swap_copy(out, self._flat_pools()[:, :, self._flat_index(blocks, num_tokens)])
            return
        for layers, group_blocks in self._by_group(blocks):
            part = self._flat_pools()[:, :, self._flat_index(group_blocks, num_tokens)]
            for p, layer in enumerate(layers.tolist()):
                self._swap_copy(out[layer], part[p])

    def _store_tokens(self, blocks, tokens: torch.Tensor) -> None:
        tokens = tokens.to(self.pools.device, non_blocking=self.swaps_are_async)
        for layers, group_blocks in self._by_group(blocks):
            index = self._flat_index(group_blocks, tokens.shape[2])
            part = tokens if len(self.groups) == 1 else tokens.index_select(0, layers)
            _bits(self._flat_pools()).index_copy_(2, index, _bits(part))

    # -- steps --
    def _placed(self, edit, tables, index: int) -> tuple:
        """A placement is one block table per group."""
        if not isinstance(edit, EditBlocks):
            raise CacheStateError(f"PagedKVCache cannot apply table edit {index}: {edit!r}")
        if not 0 <= edit.group < len(self.groups):
            raise CacheStateError(f"table edit {index} names block group {edit.group} outside "
                                  f"0..{len(self.groups) - 1}")
        tables = list(tables or ([],) * len(self.groups))
        old = tables[edit.group]
        if not 0 <= edit.keep <= len(old):
            raise CacheStateError(f"table edit {index} keeps {edit.keep} blocks of sequence "
                                  f"{edit.seq_id}, which has {len(old)}")
        bad = [b for b in edit.append if b is not None and not 0 <= b < self.num_blocks]
        if bad:
            raise CacheStateError(f"table edit {index} names blocks {bad} outside "
                                  f"0..{self.num_blocks - 1}")
        tables[edit.group] = old[:edit.keep] + list(edit.append)
        return tuple(tables)

    def block_table(self, seq_id: int, group: int = 0) -> list:
        """The block table the plans gave ``seq_id`` in block ``group``."""
        return list(self.placement(seq_id)[group])

    def block_tables(self, seq_id: int) -> list:
        """Every group's block table of ``seq_id``."""
        return [list(t) for t in self.placement(seq_id)]

    def _held_tokens(self, seq_id: int) -> int:
        return len(self.placement(seq_id)[0]) * self.block_size

    def _group_window(self, layers: tuple):
        """The window every layer of a group attends within (None: some layer reads all)."""
        windows = {self.config.window_of(layer) for layer in layers}
        return windows.pop() if len(windows) == 1 else None

    def _build_step_views(self, step: StepBatch) -> list:
        views, writes = [None] * self.config.num_layers, []
        for g, layers in enumerate(self.groups):
            tables = [self.placement(seq_id)[g] for seq_id in step.seq_ids]
            block_tables, meta, write = self._group_step(step, tables, self._group_window(layers))
            writes.append(write)
            for p, layer in enumerate(layers):
                views[layer] = PagedLayerView(
                    self.pools[p, 0], self.pools[p, 1], block_tables, step.context_lens,
                    step.query_lens, meta=meta, window=self.config.window_of(layer),
                    **self.scales_of(layer))
        self._flat_writes = writes
        return views

    def _group_step(self, step: StepBatch, tables: list, window) -> tuple:
        """One group's (block table tensor, StepMeta, flat write index) for the step."""
        width = max(len(t) for t in tables)
        self._check_window_reads(step, tables, window)
        # None: a block given back behind the window (never read); 0 pads it like the tail
        padded = [[0 if b is None else b for b in t] + [0] * (width - len(t)) for t in tables]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.config.torch_device)
        blocks = block_tables.long()[step.token_seq_index, step.positions // self.block_size]
        bs = self.block_size
        used = tuple(tuple(t[:-(-ctx // bs)]) for t, ctx in zip(tables, step.lens.context_lens))
        return (block_tables, StepMeta(step.lens, host_tables=used),
                blocks * bs + step.positions % bs)

    def _check_window_reads(self, step: StepBatch, tables: list, window) -> None:
        """Every key a layer reads this step (from its window start) must be in a held block."""
        for seq_id, table, start in zip(step.seq_ids, tables, window_starts(step.lens, window)):
            gone = next((k for k, b in enumerate(table) if b is not None), len(table))
            if start < gone * self.block_size:
                raise CacheStateError(
                    f"sequence {seq_id}: a layer reads keys from token {start} but the plans "
                    f"gave back its blocks before token {gone * self.block_size} (behind a "
                    f"sliding window)")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_layer(layer)
        flat = self._flat_pools()
        g, p = self._where[layer]
        k, v = self._encode_write(layer, k, v)
        _bits(flat[p, 0]).index_copy_(0, self._flat_writes[g], _bits(k.to(flat.dtype)))
        _bits(flat[p, 1]).index_copy_(0, self._flat_writes[g], _bits(v.to(flat.dtype)))

    def layer_view(self, layer: int) -> PagedLayerView:
        self._check_layer(layer)
        return self._views[layer]

    def read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer, num_tokens = self._check_read(seq_id, layer, num_tokens)
        g, p = self._where[layer]
        table = self.placement(seq_id)[g]
        if num_tokens and table[0] is None:
            raise CacheStateError(f"sequence {seq_id}: its first tokens were given back behind "
                                  f"a sliding window; they cannot be read")
        index = self._flat_index(table, num_tokens)
        flat = self._flat_pools()
        return flat[p, 0, index].clone(), flat[p, 1, index].clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the bytes it holds when 1-byte (torch has no CPU index_copy_ for fp8): every
    copy of a pool moves the stored encoding unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
