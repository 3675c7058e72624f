"""VMemKVCache: every request's K/V contiguous in virtual memory, pages mapped on demand.

One VirtualRange holds the whole cache. Layouts (B = slots, C = max_context tokens):

    per-layer   [layers, 2 (K,V), B, C, kv_heads, head_dim]   a page holds one layer's K (or V)
                page index of (layer, kv, slot, i) = ((layer * 2 + kv) * B + slot) * P + i
    interleaved [2 (K,V), B, C, layers, kv_heads, head_dim]   a page holds all layers' K (or V)
                page index of (kv, slot, i)        = (kv * B + slot) * P + i

where P = C / tokens_per_page pages per slot. Page group g (the manager's unit) is the fixed
set of pool pages [g * pages_per_group, (g + 1) * pages_per_group): member j backs
(layer j // 2, kv j % 2) in per-layer, (kv j) in interleaved. That arithmetic is all the cache
adds to the manager's tables; what is mapped where lives in the driver (VirtualRange).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

import vmem
from runtime.attention.base import VMemLayerView
from scheduler.managers.base import CopyPage, MapPage, SwapIn, SwapOut, UnmapPage

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError
from .base import KVCache, StepBatch
from .mapper import BackgroundMapper

LAYOUTS = ("per-layer", "interleaved")


class VMemKVCache(KVCache):
    """Executes a ``vmem`` memory manager's plans on a VirtualRange.

    ``background_mapper=True`` runs each plan's ops on a thread, layer by layer, so layer l's
    pages are mapped while layers < l compute (per-layer layout); ``write``/``layer_view`` wait
    only for their own layer. ``mapper_wait_seconds`` is the time steps spent waiting for it.
    """

    layout = "vmem"

    def __init__(self, config: CacheConfig, manager, driver: Optional[vmem.Driver] = None,
                 background_mapper: bool = False) -> None:
        super().__init__(config, manager)
        self.memory_layout = manager.layout
        self._check_manager(config, manager)
        self.driver = driver or vmem.open_driver("cuda" if config.torch_device.type == "cuda" else "host")
        self.page_bytes = manager.page_bytes
        self.tokens_per_page = manager.tokens_per_page
        self.pages_per_slot = config.max_context // self.tokens_per_page
        self.pages_per_group = manager.pages_per_group
        self.pool = vmem.PagePool(self.driver, manager.num_groups * self.pages_per_group, self.page_bytes)
        self._pool_pages = self.pool.allocate(self.pool.total_pages)  # fixed: group g -> members
        c = config
        shape = ((c.num_layers, 2, c.max_batch, c.max_context, c.num_kv_heads, c.head_dim)
                 if self.memory_layout == "per-layer" else
                 (2, c.max_batch, c.max_context, c.num_layers, c.num_kv_heads, c.head_dim))
        size_bytes = c.max_batch * c.max_context * c.bytes_per_token
        self.range = vmem.VirtualRange(self.pool, size_bytes)
        whole = self.range.tensor(0, size_bytes, c.dtype, shape)
        if self.memory_layout == "per-layer":
            self._k = [whole[layer, 0] for layer in range(c.num_layers)]
            self._v = [whole[layer, 1] for layer in range(c.num_layers)]
        else:  # k[:, :, layer]: strided, last dim contiguous
            self._k = [whole[0, :, :, layer] for layer in range(c.num_layers)]
            self._v = [whole[1, :, :, layer] for layer in range(c.num_layers)]
        self.map_seconds = 0.0
        self._mapper = BackgroundMapper(self._apply_layer_group, self._num_op_groups) \
            if background_mapper else None
        self._closed = False

    @staticmethod
    def _check_manager(config: CacheConfig, manager) -> None:
        if getattr(manager, "name", None) != "vmem":
            raise CacheConfigError(f"VMemKVCache needs a 'vmem' memory manager, got "
                                   f"{getattr(manager, 'name', manager)!r}")
        if manager.layout not in LAYOUTS:
            raise CacheConfigError(f"layout must be one of {LAYOUTS}, got {manager.layout!r}")
        if manager.num_slots != config.max_batch:
            raise CacheConfigError(f"manager has {manager.num_slots} slots but CacheConfig.max_batch "
                                   f"is {config.max_batch}; build the manager with max_slots=max_batch")
        if manager.pages_per_slot * manager.tokens_per_page != config.max_context:
            raise CacheConfigError(
                f"manager slots hold {manager.pages_per_slot * manager.tokens_per_page} tokens but "
                f"CacheConfig.max_context is {config.max_context}")
        per_page = config.layer_bytes_per_token * (1 if manager.layout == "per-layer" else config.num_layers)
        if manager.tokens_per_page * per_page != manager.page_bytes:
            raise CacheConfigError(
                f"page of {manager.page_bytes} bytes holds {manager.page_bytes / per_page:g} tokens "
                f"of this cache's {manager.layout} layout; the manager says {manager.tokens_per_page}")

    # -- executing plans --
    @property
    def _num_op_groups(self) -> int:
        """Ops are applied in independent groups: one per layer (per-layer), one (interleaved)."""
        return self.config.num_layers if self.memory_layout == "per-layer" else 1

    def execute(self, ops: Sequence) -> None:
        self._check_open()
        if not ops:
            return
        bound = self._bind_swaps(ops)
        if self._mapper is not None:
            self._mapper.submit(bound)
            return
        start = time.perf_counter()
        for group in range(self._num_op_groups):
            self._apply_layer_group(bound, group)
        self.map_seconds += time.perf_counter() - start

    def _members(self, group: int) -> Sequence[int]:
        """Member indices j of a page group touched by op group ``group`` (see module doc)."""
        return (2 * group, 2 * group + 1) if self.memory_layout == "per-layer" else (0, 1)

    def _page_index(self, member: int, slot: int, page_index: int) -> int:
        # per-layer: member j = layer * 2 + kv; interleaved: member j = kv
        return (member * self.config.max_batch + slot) * self.pages_per_slot + page_index

    def _apply_layer_group(self, bound: Sequence, group: int) -> None:
        """Apply the part of a plan (ops paired with swap buffers) that touches op group ``group``."""
        for op, buffer in bound:
            if isinstance(op, MapPage):
                base = op.group * self.pages_per_group
                for j in self._members(group):
                    self.range.map(self._page_index(j, op.slot, op.page_index), self._pool_pages[base + j])
            elif isinstance(op, UnmapPage):
                for j in self._members(group):
                    self.range.unmap(self._page_index(j, op.slot, op.page_index))
            elif isinstance(op, CopyPage):
                for j in self._members(group):
                    self.range.copy_page(self._page_index(j, op.dst_slot, op.dst_page_index),
                                         self._page_index(j, op.src_slot, op.src_page_index))
            elif isinstance(op, SwapOut):
                for layer in self._layers_of(group):  # buffer: (layers, 2, tokens, heads, dim)
                    buffer[layer, 0].copy_(self._k[layer][op.slot, :op.num_tokens])
                    buffer[layer, 1].copy_(self._v[layer][op.slot, :op.num_tokens])
            elif isinstance(op, SwapIn):
                for layer in self._layers_of(group):
                    self._k[layer][op.slot, :op.num_tokens].copy_(buffer[layer, 0])
                    self._v[layer][op.slot, :op.num_tokens].copy_(buffer[layer, 1])
            else:
                raise CacheStateError(f"VMemKVCache cannot execute {op!r}")

    def _layers_of(self, group: int) -> range:
        return range(group, group + 1) if self.memory_layout == "per-layer" else range(self.config.num_layers)

    def wait_for_mapper(self) -> None:
        """Block until every submitted plan is fully applied (no-op without a mapper)."""
        if self._mapper is not None:
            self._mapper.wait_all()

    @property
    def mapper_wait_seconds(self) -> float:
        """Time spent by steps waiting for the background mapper (0 without one)."""
        return self._mapper.wait_seconds if self._mapper is not None else 0.0

    @property
    def mapping_seconds(self) -> float:
        """Time spent applying plans, inline or on the mapper thread."""
        return self.map_seconds + (self._mapper.busy_seconds if self._mapper is not None else 0.0)

    # -- steps --
    def _index_step(self, step: StepBatch) -> None:
        slots = [self.manager.slot_of(seq_id) for seq_id in step.seq_ids]
        device = self.config.torch_device
        self._slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self._token_slots = self._slots[step.token_seq_index]

    def _ready(self, layer: int) -> None:
        self._check_open()
        self._check_layer(layer)
        if self._mapper is not None:
            self._mapper.wait_group(layer if self.memory_layout == "per-layer" else 0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._ready(layer)
        # k, v: (new_tokens, kv_heads, head_dim) -> k_cache[slot_t, pos_t] for every token t
        index = (self._token_slots, self._step.positions)
        self._k[layer].index_put_(index, k)
        self._v[layer].index_put_(index, v)

    def layer_view(self, layer: int) -> VMemLayerView:
        self._ready(layer)
        step = self._step
        return VMemLayerView(self._k[layer], self._v[layer], self._slots, step.context_lens,
                             step.query_lens, host_lens=step.lens)

    def read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        self.wait_for_mapper()
        held = self.manager.num_tokens(seq_id)
        if num_tokens > held:
            raise CacheStateError(f"sequence {seq_id} holds {held} tokens, asked to read {num_tokens}")
        slot = self.manager.slot_of(seq_id)
        return (self._k[layer][slot, :num_tokens].clone(), self._v[layer][slot, :num_tokens].clone())

    # -- lifecycle --
    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("VMemKVCache used after close()")

    def close(self) -> None:
        """Stop the mapper, unmap everything, release the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._mapper is not None:
            self._mapper.close()
        self._k = self._v = []
        self.range.close()
        for page in self._pool_pages:
            self.pool.release(page)
        self.pool.close()
