"""VMemKVCache: every request's K/V contiguous in virtual memory, pages mapped on demand.

One VirtualRange holds the whole cache. Page layouts (B = slots, C = max_context tokens):

    per-layer   [layers, 2 (K,V), B, C, kv_heads, head_dim]   a page holds one layer's K (or V)
                first page of (layer, kv, slot, i) = (((layer * 2 + kv) * B + slot) * P + i) * k
    interleaved [2 (K,V), B, C, layers, kv_heads, head_dim]   a page holds all layers' K (or V)
                first page of (kv, slot, i)        = ((kv * B + slot) * P + i) * k

where P = C / tokens_per_page page groups per slot and k = pages_per_member consecutive pages
per member (1 when a page holds whole tokens; else a token may straddle two pages); member j
backs (layer j // 2, kv j % 2) in per-layer, (kv j) in interleaved (see scheduler.geometry).
Which of the ``pool_pages`` pool pages back a member page is never chosen here: every
MapExtent names them, per layer kind (vmem_ops). The cache keeps a replica of what plans mapped
(slot -> {page index: {kind: pool pages}}) and where they placed each sequence (seq -> slot),
checks every op and step against it, and never asks a manager.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

from vmemkv import vmem
from vmemkv.runtime.attention.views import StepMeta, VMemLayerView, window_starts
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.layout import CacheKind, whole_kind_name
from vmemkv.scheduler.plan import (CopyExtent, DropSwapped, MapExtent, ReleasePages, SetSlot,
                                   SwapIn, SwapOut, UnmapExtent)

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError, MapperError
from ..memory import check_fits_device
from .base import KVCache, StepBatch
from .journal import PlanJournal
from .adapters import ADAPTER_OPS, AdapterReplica
from .mapper import BackgroundMapper, DeferredUndo
from .vmem_ops import VMemOps, cache_kinds

_OPS = (MapExtent, UnmapExtent, CopyExtent, SwapOut, SwapIn, DropSwapped,
        ReleasePages) + ADAPTER_OPS


class VMemKVCache(VMemOps, AdapterReplica, KVCache):
    """Executes vmem plans on a VirtualRange of ``config.max_batch`` slots of ``geometry``
    over a pool of ``pool_pages`` pages (default: ``num_groups`` whole page groups' worth),
    whose ops name the pool pages of layer ``kinds`` (((name, layers), ...) from the layout;
    default: one kind of every layer). The last ``released_pages`` pool pages start with no
    memory (an elastic pool below its max): created when a MapExtent first names them;
    ``ReleasePages`` gives pages' memory back.

    ``background_mapper=True`` runs each plan's ops on a thread, layer by layer, so layer l's
    pages are mapped while layers < l compute (per-layer layout); ``write``/``layer_view`` wait
    only for their own layer. ``mapper_wait_s`` is the time steps spent waiting for it.

    LoRA adapters (cache/adapters.py): a LoadAdapter's pool pages are mapped, in order, into a
    VirtualRange of the adapter's own over the same PagePool (reserved at load, closed at
    evict; applied with the plan's last op group, after every layer's unmaps);
    ``adapter_buffer`` views its bytes. ``adapter_pool_pages`` (a static split): pool pages
    ``pool_pages`` on, for adapters only.
    """

    kind = CacheKind.VMEM

    def __init__(self, config: CacheConfig, geometry: PageGeometry, num_groups: int,
                 driver: Optional[vmem.Driver] = None, background_mapper: bool = False,
                 grow_pages: bool = False, pool_pages: Optional[int] = None,
                 kinds: Optional[tuple] = None, released_pages: int = 0,
                 adapter_pool_pages: int = 0) -> None:
        super().__init__(config)
        self._check_geometry(config, geometry, num_groups)
        pool_pages = num_groups * geometry.pages_per_group if pool_pages is None else pool_pages
        if isinstance(pool_pages, bool) or not isinstance(pool_pages, int) or pool_pages < 1:
            raise CacheConfigError(f"pool_pages must be None or an int >= 1, got {pool_pages!r}")
        kinds = ((whole_kind_name(config.window_tokens), tuple(range(config.num_layers))),) \
            if kinds is None else kinds
        self._kinds = cache_kinds(kinds, geometry, config.window_of)
        self.kinds = kinds             # ((name, layers), ...), as the layout gave them
        self.pool_pages = pool_pages
        self.geometry = geometry
        self.memory_layout = geometry.layout
        self.page_bytes = geometry.page_bytes
        self.tokens_per_page = geometry.tokens_per_page
        self.pages_per_slot = config.max_context // self.tokens_per_page
        self.pages_per_group = geometry.pages_per_group
        self.num_groups = num_groups
        for name, value, most in (("released_pages", released_pages, pool_pages),
                                  ("adapter_pool_pages", adapter_pool_pages, float("inf"))):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise CacheConfigError(f"{name} must be an int in [0, {most}], got {value!r}")
        self.adapter_pool_pages = adapter_pool_pages
        self._in_service = in_service = pool_pages - released_pages   # the rest: no memory yet
        check_fits_device(f"VMemKVCache pool of {in_service + adapter_pool_pages} pages of "
                          f"{self.page_bytes} bytes",
                          (in_service + adapter_pool_pages) * self.page_bytes,
                          config.torch_device, committed=not grow_pages)
        self._init_adapters(self.page_bytes, pool_pages + adapter_pool_pages)
        self._adapter_ranges: dict = {}   # adapter_id -> its VirtualRange (applied plans)
        self._grow_pages = grow_pages   # pages created on first mapping (vmem.PagePool(grow=True))
        # the replica: slot -> {page index: {kind: pool pages mapped, from member page 0}}
        self._spots: list[dict] = [dict() for _ in range(config.max_batch)]
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
        total = self.pool_pages + self.adapter_pool_pages   # (a split's adapter pages last:
        committed = total if self._in_service == self.pool_pages else self._in_service
        self.pool = vmem.PagePool(self.driver, total, self.page_bytes,   # made when mapped if
                                  grow=self._grow_pages, committed_pages=committed)  # released)
        self._pool_pages = self.pool.allocate(self.pool.total_pages)   # pool page -> page id
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
        """Apply the plan all or nothing (a failed op undoes the applied ones in reverse, then
        PlanExecutionError; a background mapper's MapperPlanError surfaces at the next wait)."""
        self._check_open()
        for index, op in enumerate(ops):   # refuse a plan we cannot run before touching memory
            if not isinstance(op, _OPS):
                raise CacheStateError(f"VMemKVCache cannot execute op {index} of the plan: {op!r}")
            if isinstance(op, (SwapOut, SwapIn)) and not 0 <= op.slot < self.config.max_batch:
                raise CacheStateError(f"op {index} of the plan names slot {op.slot} outside "
                                      f"0..{self.config.max_batch - 1}: {op!r}")
        if self._mapper is not None:
            self._mapper.wait_all()        # the previous plan is done (or its error raised)
        bound = self._bind_swaps(ops)
        if not bound:
            return
        self._step = None   # the plan may move the step's memory: its writes need a new step
        journal, plan = PlanJournal(self._swapped_before), None
        try:
            bound = self._bind_ops(bound, journal)
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
        except BaseException:      # an interrupt before this returned: as if never sent
            if self._mapper is not None and self._mapper.holds(plan):
                with contextlib.suppress(MapperError):
                    self._mapper.wait_all()    # applied whole, or failed and undone there
            self._undo_plan(journal)           # idempotent
            raise

    def wait_for_plan(self) -> None:
        self.wait_for_mapper()

    def mapped_extents(self, slot: int) -> dict:
        """{page_index: {kind: pool pages}} the plans have mapped under ``slot``."""
        return {pi: dict(extents) for pi, extents in self._spots[slot].items()}

    @property
    def mapped_pool_pages(self) -> int:
        """Distinct pool pages mapped somewhere (each counted once however often mapped)."""
        return len({p for spots in self._spots for extents in spots.values()
                    for pages in extents.values() for p in pages})

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
        """Tokens from the first page the first kind has mapped to the end of its run of
        mapped bytes (``_check_reads`` checks every kind's reads)."""
        kind = next(iter(self._kinds.values()))
        spots, tpp = self._spots[self.placement(seq_id)], self.tokens_per_page
        mapped = [pi for pi, extents in spots.items() if kind.name in extents]
        start = min(mapped) * tpp if mapped else 0
        end = self.pages_per_slot * tpp
        gap = self._unbacked(self.placement(seq_id), kind, start, end)
        return end if gap is None else gap

    def _write_gap(self, seq_id: int, start: int, end: int) -> Optional[str]:
        """Whether every kind has mapped the bytes of tokens [start, end): the pages of this
        step's writes only (``_check_reads`` checks each kind's reads)."""
        slot = self.placement(seq_id)
        for kind in self._kinds.values():
            gap = self._unbacked(slot, kind, start, end)
            if gap is not None:
                return f"the plans mapped no memory of its {kind.name!r} layers for token {gap}"
        return None

    def _check_reads(self, step: StepBatch, slots: tuple) -> None:
        """Every key a layer reads this step (from its kind's window start) and every token
        written must lie in memory its kind has mapped."""
        for kind in self._kinds.values():
            starts = window_starts(step.lens, kind.window)
            for seq_id, slot, start, end in zip(step.seq_ids, slots, starts, step.lens.context_lens):
                gap = self._unbacked(slot, kind, start, end)
                if gap is not None:
                    raise CacheStateError(
                        f"sequence {seq_id}: its {kind.name!r} layers read keys from token "
                        f"{start} but the plans mapped no memory for token {gap} (given back "
                        f"behind a sliding window?)")

    def _build_step_views(self, step: StepBatch) -> list:
        slots = tuple(self.placement(seq_id) for seq_id in step.seq_ids)
        if len(set(slots)) != len(slots):
            raise CacheStateError(f"sequences {list(step.seq_ids)} share slots {list(slots)}")
        self._check_reads(step, slots)
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
        k, v = self._encode_write(layer, k, v)
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
        layer, num_tokens = self._check_read(seq_id, layer, num_tokens)
        slot = self.placement(seq_id)
        kind = next(k for k in self._kinds.values() if layer in k.layers)
        gap = self._unbacked(slot, kind, 0, num_tokens)
        if gap is not None:
            raise CacheStateError(f"sequence {seq_id}: layer {layer} has no memory mapped for "
                                  f"token {gap} (given back behind a sliding window?); it "
                                  f"cannot be read")
        return (self._k[layer][slot, :num_tokens].clone(), self._v[layer][slot, :num_tokens].clone())

    def check_integrity(self) -> None:
        """Every page the plans mapped is mapped at the right range page to the pool page they
        named, and nothing else is mapped (so no mapping is half done and none is leaked);
        pool counts are consistent."""
        super().check_integrity()
        self.wait_for_mapper()
        assert self.range.mapped_pages() == self._expected_mappings(), \
            "range mappings differ from the plans' mappings"
        self._check_adapter_replica()
        assert set(self._adapter_ranges) == set(self._adapters), "adapter ranges"
        for adapter_id, (pages, _) in self._adapters.items():
            assert self._adapter_ranges[adapter_id].mapped_pages() == \
                {i: self._pool_pages[p] for i, p in enumerate(pages)}, ("adapter pages", adapter_id)
        self.pool.check_integrity()

    # -- LoRA adapters --
    def adapter_buffer(self, adapter_id: str) -> torch.Tensor:
        """The ``num_bytes`` of resident adapter ``adapter_id``: a 1-D uint8 view, zero-copy,
        of the pool pages its LoadAdapter named (in order). CacheStateError if not resident."""
        self._check_open()
        self.wait_for_mapper()
        _, num_bytes = self._adapter_entry(adapter_id)
        return self._adapter_ranges[adapter_id].tensor(0, num_bytes)

    def _map_adapter(self, adapter_id: str, pages: tuple) -> None:
        rng = vmem.VirtualRange(self.pool, len(pages) * self.page_bytes)
        try:
            for index, page in enumerate(pages):
                rng.map(index, self._pool_pages[page])
        except BaseException:
            rng.close()
            raise
        self._adapter_ranges[adapter_id] = rng

    def _unmap_adapter(self, adapter_id: str) -> None:
        self._adapter_ranges.pop(adapter_id).close()

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
        """Release whatever exists, in dependency order: mapper, views, range, pool, driver."""
        if self._mapper is not None:
            self._mapper.close()
        self._k, self._v, self._step, self._views = [], [], None, []
        for rng in getattr(self, "_adapter_ranges", {}).values():
            rng.close()
        self._adapter_ranges = {}
        if self.range is not None:
            self.range.close()
        if self.pool is not None:
            for page in getattr(self, "_pool_pages", ()):
                self.pool.release(page)
            self._pool_pages = []
            self.pool.close()
        if self._own_driver:
            self.driver.close()
