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

from vmemkv import vmem
from vmemkv.runtime.attention.base import VMemLayerView
from vmemkv.scheduler.managers.base import CopyPage, MapPage, SwapIn, SwapOut, UnmapPage

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError
from .base import KVCache, PlanJournal, StepBatch, check_fits_device
from .mapper import BackgroundMapper, DeferredUndo

LAYOUTS = ("per-layer", "interleaved")
_OPS = (MapPage, UnmapPage, CopyPage, SwapOut, SwapIn)


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
        self._check_manager(config, manager)
        self.memory_layout = manager.layout
        self.page_bytes = manager.page_bytes
        self.tokens_per_page = manager.tokens_per_page
        self.pages_per_slot = config.max_context // self.tokens_per_page
        self.pages_per_group = manager.pages_per_group
        check_fits_device(f"VMemKVCache pool of {manager.num_groups * self.pages_per_group} pages "
                          f"of {self.page_bytes} bytes",
                          manager.num_groups * self.pages_per_group * self.page_bytes,
                          config.torch_device)
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
        self.pool = vmem.PagePool(self.driver, self.manager.num_groups * self.pages_per_group,
                                  self.page_bytes)
        self._pool_pages = self.pool.allocate(self.pool.total_pages)  # fixed: group g -> members
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
        self._mapper = BackgroundMapper(self._apply_logged, self._num_op_groups) \
            if background_mapper else None

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
        """Apply the plan, all or nothing: if an op fails, what was applied is undone (in
        reverse) and PlanExecutionError raised; with a background mapper the same happens on
        the mapper thread and the error (MapperPlanError) surfaces at the next wait."""
        self._check_open()
        for index, op in enumerate(ops):   # refuse a plan we cannot run before touching memory
            if not isinstance(op, _OPS):
                raise CacheStateError(f"VMemKVCache cannot execute op {index} of the plan: {op!r}")
        if self._mapper is not None:
            self._mapper.wait_all()        # the previous plan is done (or its error raised)
        bound = self._bind_swaps(ops)
        if not bound:
            return
        plan = (bound, PlanJournal(self._swapped_before))
        if self._mapper is not None:
            self._mapper.submit(plan)
            return
        start = time.perf_counter()
        try:
            for group in range(self._num_op_groups):
                self._apply_logged(plan, group)
        finally:
            self.map_seconds += time.perf_counter() - start

    def wait_for_plan(self) -> None:
        self.wait_for_mapper()

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

    def _members(self, group: int) -> Sequence[int]:
        """Member indices j of a page group touched by op group ``group`` (see module doc)."""
        return (2 * group, 2 * group + 1) if self.memory_layout == "per-layer" else (0, 1)

    def _page_index(self, member: int, slot: int, page_index: int) -> int:
        # per-layer: member j = layer * 2 + kv; interleaved: member j = kv
        return (member * self.config.max_batch + slot) * self.pages_per_slot + page_index

    def _apply_layer_group(self, bound: Sequence, group: int,
                           journal: Optional[PlanJournal] = None) -> None:
        """Apply the part of a plan (ops paired with swap buffers) that touches op group
        ``group``, recording the inverse of every primitive in ``journal``."""
        journal = journal if journal is not None else PlanJournal({})
        rng = self.range
        for index, (op, buffer) in enumerate(bound):
            journal.op_index = index
            if isinstance(op, MapPage):
                base = op.group * self.pages_per_group
                for j in self._members(group):
                    page_index = self._page_index(j, op.slot, op.page_index)
                    rng.map(page_index, self._pool_pages[base + j])
                    journal.add(lambda pi=page_index: rng.unmap(pi))
            elif isinstance(op, UnmapPage):
                for j in self._members(group):
                    page_index = self._page_index(j, op.slot, op.page_index)
                    page_id = rng.unmap(page_index)
                    journal.add(lambda pi=page_index, pid=page_id: rng.map(pi, pid))
            elif isinstance(op, CopyPage):
                for j in self._members(group):
                    dst = self._page_index(j, op.dst_slot, op.dst_page_index)
                    self._save_bytes(journal, dst * self.page_bytes, self.page_bytes)
                    rng.copy_page(dst, self._page_index(j, op.src_slot, op.src_page_index))
            elif isinstance(op, SwapOut):
                for layer in self._layers_of(group):  # buffer: (layers, 2, tokens, heads, dim)
                    buffer[layer, 0].copy_(self._k[layer][op.slot, :op.num_tokens])
                    buffer[layer, 1].copy_(self._v[layer][op.slot, :op.num_tokens])
            elif isinstance(op, SwapIn):
                for layer in self._layers_of(group):
                    for cache in (self._k[layer], self._v[layer]):
                        target = cache[op.slot, :op.num_tokens]
                        saved = target.clone()
                        journal.add(lambda t=target, s=saved: t.copy_(s))
                    self._k[layer][op.slot, :op.num_tokens].copy_(buffer[layer, 0])
                    self._v[layer][op.slot, :op.num_tokens].copy_(buffer[layer, 1])
            else:
                raise CacheStateError(f"VMemKVCache cannot execute {op!r}")

    def _save_bytes(self, journal: PlanJournal, offset: int, num_bytes: int) -> None:
        """Keep a copy of bytes about to be overwritten; undo writes them back."""
        view = self.range.tensor(offset, num_bytes)
        saved = view.clone()
        journal.add(lambda: self.range.tensor(offset, num_bytes).copy_(saved))

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

    def layer_tensors(self, layer: int) -> tuple:
        """The whole K and V virtual tensors of ``layer``, each ``(max_batch, max_context,
        kv_heads, head_dim)`` (strided in the interleaved layout). Zero-copy views over the
        range: only rows and tokens the manager has mapped may be touched."""
        self._check_open()
        return self._k[layer], self._v[layer]

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

    def check_integrity(self) -> None:
        """Every page group the manager has mapped under a slot is mapped, member by member,
        at the right page indices of the range, and nothing else is mapped (so no mapping is
        half done and none is leaked); pool counts are consistent."""
        super().check_integrity()
        self.wait_for_mapper()
        expected = {}
        for slot in range(self.config.max_batch):
            for pi, g in self.manager.mapped_pages(slot).items():
                for j in range(self.pages_per_group):
                    expected[self._page_index(j, slot, pi)] = self._pool_pages[g * self.pages_per_group + j]
        assert self.range.mapped_pages() == expected, "range mappings differ from the manager's tables"
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
