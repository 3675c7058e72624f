"""VMemKVCache: every request's K/V contiguous in virtual memory, pages mapped on demand.

One VirtualRange holds the whole cache. Page layouts (B = slots, C = max_context tokens):

    per-layer   [layers, 2 (K,V), B, C, kv_heads, head_dim]   a page holds one layer's K (or V)
                first page of (layer, kv, slot, i) = (((layer * 2 + kv) * B + slot) * P + i) * k
    interleaved [2 (K,V), B, C, layers, kv_heads, head_dim]   a page holds all layers' K (or V)
                first page of (kv, slot, i)        = ((kv * B + slot) * P + i) * k

where P = C / tokens_per_page page groups per slot and k = pages_per_member consecutive pages
per member (1 when a page holds whole tokens; else a token may straddle two pages). Page group
g (the manager's unit) is the fixed set of pool pages [g * pages_per_group, (g + 1) *
pages_per_group): member j, k pages, backs (layer j // 2, kv j % 2) in per-layer, (kv j) in
interleaved (see scheduler.geometry). A hybrid cache (``pool_pages``: full and windowed layers,
per-layer) instead binds pool pages to each PART of a group when a plan first maps it and takes
them back at ReleaseGroup (vmem_binding, vmem_parts). The cache
keeps a replica of what plans mapped (slot -> {page index: group}) and where they placed each
sequence (seq -> slot); it never asks a manager.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from vmemkv import vmem
from vmemkv.runtime.attention.base import StepMeta, VMemLayerView, window_starts
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.plan import (CopyGroup, DropSwapped, MapGroup, ReleaseGroup, ResizeGroup,
                                   SetSlot, SwapIn, SwapOut, UnmapGroup)

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError
from ..memory import check_fits_device
from .base import KVCache, StepBatch
from .journal import PlanJournal
from .mapper import BackgroundMapper, DeferredUndo
from .vmem_ops import VMemOps
from .vmem_parts import PartOps
from .vmem_slices import SliceOps

_OPS = (MapGroup, UnmapGroup, ReleaseGroup, ResizeGroup, CopyGroup, SwapOut, SwapIn, DropSwapped)


class VMemKVCache(VMemOps, PartOps, SliceOps, KVCache):
    """Executes vmem plans on a VirtualRange of ``config.max_batch`` slots over a pool of
    ``num_groups`` page groups of ``geometry`` (fixed pages per group), or, with
    ``pool_pages``, a hybrid pool of that many pages bound to group parts by the plans
    (needs the per-layer layout and a config with both full and windowed layers), or, where
    members span k > 1 pages and groups are not split, a byte-mapped pool whose groups are
    backed by the pages ResizeGroup ops give them (vmem_slices).

    ``background_mapper=True`` runs each plan's ops on a thread, layer by layer, so layer l's
    pages are mapped while layers < l compute (per-layer layout); ``write``/``layer_view`` wait
    only for their own layer. ``mapper_wait_s`` is the time steps spent waiting for it.
    """

    kind = CacheKind.VMEM

    def __init__(self, config: CacheConfig, geometry: PageGeometry, num_groups: int,
                 driver: Optional[vmem.Driver] = None, background_mapper: bool = False,
                 grow_pages: bool = False, pool_pages: Optional[int] = None) -> None:
        super().__init__(config)
        self._check_geometry(config, geometry, num_groups)
        self._slices = self._slice_binding(geometry, pool_pages)
        self._parts, self._binding = (None, None) if self._slices is not None else \
            self._part_binding(config, geometry, pool_pages)
        self.pool_pages = pool_pages
        self.geometry = geometry
        self.memory_layout = geometry.layout
        self.page_bytes = geometry.page_bytes
        self.tokens_per_page = geometry.tokens_per_page
        self.pages_per_slot = config.max_context // self.tokens_per_page
        self.pages_per_group = geometry.pages_per_group
        self.num_groups = num_groups
        total_pages = pool_pages if pool_pages is not None else num_groups * self.pages_per_group
        check_fits_device(f"VMemKVCache pool of {total_pages} pages of {self.page_bytes} bytes",
                          total_pages * self.page_bytes, config.torch_device,
                          committed=not grow_pages)
        self._grow_pages = grow_pages   # pages created on first mapping (vmem.PagePool(grow=True))
        self._slot_pages: list[dict] = [dict() for _ in range(config.max_batch)]  # replica
        self._closed = True      # until fully built: close() releases only what exists
        self.pool = self.range = self._mapper = None
        self._own_driver = driver is None
        device = config.torch_device
        self.driver = driver or (vmem.open_driver("cuda", device.index) if device.type == "cuda"
                                 else vmem.open_driver("host"))
        try:
            self._build(config, background_mapper)
        except BaseException:
            self._release()      # nothing stays allocated after a failed build (e.g. an OOM)
            raise
        self._closed = False

    def _build(self, c: CacheConfig, background_mapper: bool) -> None:
        total_pages = self.pool_pages or self.num_groups * self.pages_per_group
        self.pool = vmem.PagePool(self.driver, total_pages, self.page_bytes, grow=self._grow_pages)
        # fixed: group g -> members; hybrid: indexes the binding hands out
        self._pool_pages = self.pool.allocate(self.pool.total_pages)
        per_layer = self.geometry.per_layer
        shape = ((c.num_layers, 2, c.max_batch, c.max_context, c.num_kv_heads, c.head_dim)
                 if per_layer else
                 (2, c.max_batch, c.max_context, c.num_layers, c.num_kv_heads, c.head_dim))
        size_bytes = c.max_batch * c.max_context * c.bytes_per_token
        self.range = vmem.VirtualRange(self.pool, size_bytes)
        whole = self.range.tensor(0, size_bytes, c.storage_dtype, shape)
        if per_layer:
            self._k = [whole[layer, 0] for layer in range(c.num_layers)]
            self._v = [whole[layer, 1] for layer in range(c.num_layers)]
        else:  # k[:, :, layer]: strided, last dim contiguous
            self._k = [whole[0, :, :, layer] for layer in range(c.num_layers)]
            self._v = [whole[1, :, :, layer] for layer in range(c.num_layers)]
        self._inline_mapping_s = 0.0   # plans applied on the step thread
        self._mapper = BackgroundMapper(self._apply_logged, self.geometry.num_op_groups) \
            if background_mapper else None

    @staticmethod
    def _check_geometry(config: CacheConfig, geometry: PageGeometry, num_groups: int) -> None:
        if not isinstance(geometry, PageGeometry):
            raise CacheConfigError(f"VMemKVCache needs a PageGeometry, got {geometry!r}")
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise CacheConfigError(f"num_groups must be an int >= 1, got {num_groups!r}")
        if (geometry.num_layers, geometry.layer_bytes_per_token) != \
                (config.num_layers, config.layer_bytes_per_token):
            raise CacheConfigError(
                f"geometry is for {geometry.num_layers} layers of {geometry.layer_bytes_per_token} "
                f"bytes per token; CacheConfig has {config.num_layers} of "
                f"{config.layer_bytes_per_token}")
        if config.max_context % geometry.tokens_per_page:
            raise CacheConfigError(
                f"CacheConfig.max_context {config.max_context} is not a whole number of pages of "
                f"{geometry.tokens_per_page} tokens; round it up to "
                f"{geometry.round_up_tokens(config.max_context)}")

    # -- executing plans --
    def execute(self, ops: Sequence) -> None:
        """Apply the plan, all or nothing: if an op fails, what was applied is undone (in
        reverse) and PlanExecutionError raised; with a background mapper the same happens on
        the mapper thread and the error (MapperPlanError) surfaces at the next wait."""
        self._check_open()
        for index, op in enumerate(ops):   # refuse a plan we cannot run before touching memory
            if not isinstance(op, _OPS):
                raise CacheStateError(f"VMemKVCache cannot execute op {index} of the plan: {op!r}")
            self._check_part_op(index, op)
        if self._mapper is not None:
            self._mapper.wait_all()        # the previous plan is done (or its error raised)
        for index, op in enumerate(ops):
            slots = (op.src_slot, op.dst_slot) if isinstance(op, CopyGroup) else \
                (getattr(op, "slot", 0),)
            if any(not 0 <= s < self.config.max_batch for s in slots):
                raise CacheStateError(f"op {index} of the plan names slot(s) {slots} outside "
                                      f"0..{self.config.max_batch - 1}: {op!r}")
        self._retain(None)
        bound = self._bind_swaps(ops)
        if not bound:
            return
        journal = PlanJournal(self._swapped_before)
        bound = self._note_mappings(bound, journal)
        plan = (bound, journal)
        if self._mapper is not None:
            self._mapper.submit(plan)
            return
        start = time.perf_counter()
        try:
            for group in range(self.geometry.num_op_groups):
                self._apply_logged(plan, group)
        finally:
            self._inline_mapping_s += time.perf_counter() - start
        self._retain(journal)

    def wait_for_plan(self) -> None:
        self.wait_for_mapper()

    def mapped_pages(self, slot: int) -> dict:
        """{page_index: group} the plans have mapped under ``slot`` (live or deferred)."""
        return dict(self._slot_pages[slot])

    def _apply_logged(self, plan: tuple, group: int) -> None:
        """Apply op group ``group`` of a bound plan; on failure undo the WHOLE plan so far
        (earlier groups included) and raise PlanExecutionError."""
        bound, journal = plan
        try:
            self._apply_layer_group(bound, group, journal)
        except Exception as error:
            if self._mapper is not None and self._mapper.on_thread():
                raise DeferredUndo(lambda e=error: self._fail_plan(journal, e), error) from error
            raise self._fail_plan(journal, error) from error
        except BaseException:     # KeyboardInterrupt and friends: undo, then let it go on
            self._fail_plan(journal, RuntimeError("interrupted"))
            raise

    def wait_for_mapper(self) -> None:
        """Block until every submitted plan is fully applied (no-op without a mapper)."""
        if self._mapper is not None:
            self._mapper.wait_all()

    @property
    def mapper_wait_s(self) -> float:
        """Seconds steps spent waiting for the background mapper (0 without one)."""
        return self._mapper.wait_s if self._mapper is not None else 0.0

    @property
    def mapping_s(self) -> float:
        return self._inline_mapping_s + (self._mapper.busy_s if self._mapper is not None else 0.0)

    @property
    def mapping_stall_s(self) -> float:
        return self._inline_mapping_s + self.mapper_wait_s

    # -- steps --
    def _placed(self, edit, old, index: int) -> int:
        if not isinstance(edit, SetSlot):
            raise CacheStateError(f"VMemKVCache cannot apply table edit {index}: {edit!r}")
        if not 0 <= edit.slot < self.config.max_batch:
            raise CacheStateError(f"table edit {index} places sequence {edit.seq_id} on slot "
                                  f"{edit.slot}, outside 0..{self.config.max_batch - 1}")
        return edit.slot

    def _held_tokens(self, seq_id: int) -> int:
        pages = self._slot_pages[self.placement(seq_id)]
        if self._slices is not None:
            return self._slice_held_tokens(pages)
        n = self._first_held_page(pages)
        while n in pages:              # the run of pages mapped under the slot
            n += 1
        return n * self.tokens_per_page

    @staticmethod
    def _first_held_page(pages: dict) -> int:
        """The first page a live sequence holds: 0, or past the pages plans gave back behind
        a sliding window (scheduler.managers.window)."""
        return 0 if 0 in pages or not pages else min(pages)

    def _check_window_reads(self, step: StepBatch, slots: tuple) -> None:
        """Every key a layer reads this step (from its window start) must be mapped."""
        first_read = window_starts(step.lens, self.config.window_tokens)
        for seq_id, slot, start in zip(step.seq_ids, slots, first_read):
            held = self._first_held_page(self._slot_pages[slot]) * self.tokens_per_page
            if start < held:
                raise CacheStateError(
                    f"sequence {seq_id}: a layer reads keys from token {start} but the plans "
                    f"gave back its memory before token {held} (behind a sliding window)")

    def _build_step_views(self, step: StepBatch) -> list:
        slots = tuple(self.placement(seq_id) for seq_id in step.seq_ids)
        if len(set(slots)) != len(slots):
            raise CacheStateError(f"sequences {list(step.seq_ids)} share slots {list(slots)}")
        self._check_window_reads(step, slots)
        if self._binding is not None:
            self._check_part_reads(step, slots)
        self._slots = torch.tensor(slots, dtype=torch.int64, device=self.config.torch_device)
        self._token_slots = self._slots[step.token_seq_index]
        meta = StepMeta(step.lens, host_slots=slots)
        window = self.config.window_of
        return [VMemLayerView(k, v, self._slots, step.context_lens, step.query_lens, meta=meta,
                              window=window(layer), **self.scales_of(layer))
                for layer, (k, v) in enumerate(zip(self._k, self._v))]

    def _ready(self, layer: int) -> None:
        self._check_open()
        self._check_layer(layer)
        if self._mapper is not None:
            self._mapper.wait_group(self.geometry.op_group_of_layer(layer))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._ready(layer)
        # k, v: (new_tokens, kv_heads, head_dim) -> k_cache[slot_t, pos_t] for every token t
        index = (self._token_slots, self._step.positions)
        k, v = self.encode(layer, k, v)
        self._k[layer].index_put_(index, k.to(self._k[layer].dtype))
        self._v[layer].index_put_(index, v.to(self._v[layer].dtype))

    def layer_tensors(self, layer: int) -> tuple:
        """The whole K and V virtual tensors of ``layer``, each ``(max_batch, max_context,
        kv_heads, head_dim)`` (strided in the interleaved layout). Zero-copy views over the
        range: only rows and tokens the plans have mapped may be touched."""
        self._check_open()
        return self._k[layer], self._v[layer]

    def layer_view(self, layer: int) -> VMemLayerView:
        self._ready(layer)
        return self._views[layer]

    def read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        self.wait_for_mapper()
        self._check_read(seq_id, num_tokens)
        slot = self.placement(seq_id)
        if num_tokens and self._first_held_page(self._slot_pages[slot]):
            raise CacheStateError(f"sequence {seq_id}: its first tokens were given back behind "
                                  f"a sliding window; they cannot be read")
        if self._binding is not None:
            self._check_part_read(seq_id, slot, layer, num_tokens)
        return (self._k[layer][slot, :num_tokens].clone(), self._v[layer][slot, :num_tokens].clone())

    def check_integrity(self) -> None:
        """Every page group the plans mapped under a slot is mapped, member by member, at the
        right page indices of the range, and nothing else is mapped (so no mapping is half
        done and none is leaked); pool counts are consistent."""
        super().check_integrity()
        self.wait_for_mapper()
        if self._binding is not None or self._slices is not None:
            expected = self._expected_part_mappings() if self._binding is not None else \
                self._expected_slice_mappings()
            assert self.range.mapped_pages() == expected, \
                "range mappings differ from the plans' part (or slice) mappings"
            self.pool.check_integrity()
            return
        expected = {}
        for slot, pages in enumerate(self._slot_pages):
            for pi, g in pages.items():
                for j in range(self.geometry.num_members):
                    for page_index, pool_page in self._member_pages(j, slot, pi, g):
                        expected[page_index] = self._pool_pages[pool_page]
        assert self.range.mapped_pages() == expected, "range mappings differ from the plans' mappings"
        self.pool.check_integrity()

    # -- lifecycle --
    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("VMemKVCache used after close()")
        self._check_usable()

    def close(self) -> None:
        """Stop the mapper, unmap everything, release the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        """Release whatever exists, in dependency order: mapper, range, pool, own driver."""
        if self._mapper is not None:
            self._mapper.close()
        self._k = self._v = []
        if self.range is not None:
            self.range.close()
        if self.pool is not None:
            for page in getattr(self, "_pool_pages", ()):
                self.pool.release(page)
            self._pool_pages = []
            self.pool.close()
        if self._own_driver:
            self.driver.close()
