"""VMemCache: a transformers ``Cache`` on the vmem layout, for plain ``model.generate``.

    cache = VMemCache.from_model_config(model.config, max_batch=4, max_context=512)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20)

One static batch: batch row b owns vmem slot b, and every row has the same length (HF pads on the
left and masks the pads). Per layer (per-layer layout; interleaved is the same, strided):

    k_cache  (max_batch, capacity, kv_heads, head_dim)    one virtual tensor, pages mapped on demand
             rows 0..B-1 hold this batch; tokens [0, L) of each row are written
    update   k_new (B, kv_heads, q, head_dim) -> k_cache[:B, L:L+q]              in place
    returns  k_cache[:B, :L+q].transpose(1, 2) -> (B, kv_heads, L+q, head_dim)  a view, no copy

The VMemCache owns a memory manager, which owns the truth about what is allocated, and the
VMemKVCache that executes its plans: the first layer of a forward that writes past what it holds
grows every row through ``manager.append`` and hands the executor the plan (map ops, physical
pages mapped through the real driver, and the rows' slots) before writing, as one
StepTransaction (runtime/transaction.py: all or nothing). ``reset()`` frees the rows; their
pages stay mapped (the manager's deferred reclamation), so the next ``generate`` reuses them
without mapping anything. A model with sliding-window layers gets a window-aware manager
(``CacheConfig.layer_windows``): before a forward writes, the rows' memory wholly behind the
windowed layers' windows is given back (``release_behind_window``), and those layers return
only their window's keys (cache_layer.VMemLayer).
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from vmemkv.scheduler.geometry import resolve_layout
from vmemkv.scheduler.plan import StepPlan

from ..config import CacheConfig, parse_dtype
from ..errors import CacheConfigError, CacheStateError
from ..kv import (KV, check_kv_arguments, in_model_dtype, make_kv, same_tokens_page_bytes,
                  vmem_geometry)
from ..interrupts import deferred_interrupts
from ..transaction import StepTransaction, cache_executor
from .cache_copy import copy_cache, growth_room, needs_contiguous_kv
from .cache_guard import ForwardGuard
from .cache_layer import VMemLayer, window_offset
from .errors import BatchTooLargeError, CacheCapacityError, ContextOverflowError  # noqa: F401
from .cache_checks import (check_beam_index, check_crop_count, check_crop_keeps_window,
                           check_forward_start, check_layer_idx, check_update_states,
                           crop_floor_tokens, given_back_tokens, sized_to_pages)
from .support import (check_cache_layers, check_generate_feeds_new_tokens, kv_shape_of,
                      layer_windows_of, text_config)


@dataclasses.dataclass(frozen=True)
class VMemCacheStats:
    """Memory of a VMemCache. Pages are the driver's physical pages (all layers' K and V)."""
    batch: int             # rows in use
    seq_len: int           # tokens per row (layer 0)
    mapped_pages: int      # pages mapped in the virtual range (incl. pages kept after reset)
    page_bytes: int
    live_bytes: int        # K/V bytes of the tokens cached: batch * seq_len * bytes_per_token
    reserved_bytes: int    # size of the virtual range: max_batch * capacity * bytes_per_token
    committed_bytes: int   # physical memory created so far (pages are created on first mapping,
                           # up to cache_bytes, and kept until close)
    budget_bytes: int      # cache_bytes: the most committed_bytes can reach

    @property
    def mapped_bytes(self) -> int:
        return self.mapped_pages * self.page_bytes


def cache_config_from_model(config, max_batch: int, max_context: int, dtype=None,
                            device: str = "cpu", kv_cache_dtype: str = "auto") -> CacheConfig:
    """The CacheConfig of an HF model config (its decoder's text config for multimodal ones)."""
    text = text_config(config)
    check_cache_layers(text, "VMemCache", CacheConfigError)
    check_generate_feeds_new_tokens(config, "VMemCache", CacheConfigError)
    dtype = parse_dtype(dtype if dtype is not None else (getattr(text, "dtype", None) or torch.float32))
    return CacheConfig(**kv_shape_of(text), dtype=dtype, device=str(device), max_batch=max_batch,
                       max_context=max_context, layer_windows=layer_windows_of(text),
                       kv_cache_dtype=kv_cache_dtype)


class VMemCache(Cache):
    """A transformers Cache whose K/V live in a VMemKVCache (see the module docstring).

    Guarantees: returned K/V are views of the virtual tensors (no copy; with a
    ``kv_cache_dtype`` other than the model's, decoded copies of them); physical pages are
    mapped only when a row grows into them; an update that raises (BatchTooLargeError,
    ContextOverflowError, CacheCapacityError, CacheStateError, NonFiniteKVError) changes nothing
    (a write that fails in the copy gives back the rows it claimed; a later one's grown pages stay
    held, for its retry). Inference only: writes are in place, so an update whose states require
    grad with grad mode on is refused (CacheStateError) before writing (a cache built under
    ``torch.inference_mode`` serves a plain ``generate`` too). ``crop`` goes back as far as the
    memory given back behind a window allows (``cache_checks.crop_floor_tokens``). Call
    ``reset()`` before reusing the cache for new prompts (as with HF's StaticCache; without it
    ``generate`` continues the cached sequences).
    """

    def __init__(self, config: CacheConfig, layout: str = "per-layer",
                 page_bytes: int | None = None, cache_bytes: int | None = None) -> None:
        check_kv_arguments("VMemCache", config, page_bytes=page_bytes)   # 0: not the default
        with torch.inference_mode(False):   # tensors a later plain forward may write in place
            self._build(config, layout, page_bytes, cache_bytes)
        self._contiguous = False    # update returns contiguous copies at batch >= 2 (a family)
        self._model_config = None   # the HF config it was built from (``_bind_model``)

    def _build(self, config: CacheConfig, layout: str, page_bytes: int | None,
               cache_bytes: int | None) -> None:
        plain = in_model_dtype(config)    # a page holds what it would in the model's dtype
        layout = resolve_layout(layout, plain if page_bytes is None else config, page_bytes,
                                on_cuda=config.torch_device.type == "cuda")   # "auto" resolved
        geometry = vmem_geometry(config, layout, page_bytes or same_tokens_page_bytes(config, layout))
        capacity = geometry.round_up_tokens(config.max_context)  # whole pages; limit stays max_context
        self.kv: KV = make_kv(sized_to_pages(config, capacity, geometry), "vmem",
                              layout=layout, page_bytes=geometry.page_bytes, cache_bytes=cache_bytes,
                              grow_pages=True)
        self.manager = self.kv.manager     # this cache plans; self.kv.cache (VMemKVCache) executes
        # where its K/V live, as torch names the model's tensors there (config "cuda": cuda:<i>;
        # "cpu:0": cpu): update's states are checked against it, not the config's spelling
        self._device = self.kv.layer_tensors(0)[0].device
        self._txn = StepTransaction(self.manager, cache_executor(self.kv), tables=self.kv.tables)
        super().__init__(layers=[VMemLayer(self, i, config.window_of(i))
                                 for i in range(config.num_layers)])
        self.config = config
        self._rows: list[int] = []                  # seq id of batch row b (its slot is b)
        self._written = [0] * config.num_layers     # tokens per row written in each layer
        self._next_id, self._closed = 0, False
        self._slid_to = 0     # crop's bound: a query here reads no key whose memory was given back
        self._guard = ForwardGuard(config.num_layers)   # one thread's forward at a time

    @classmethod
    def from_model_config(cls, config, max_batch: int, max_context: int, dtype=None,
                          device: str = "cpu", layout: str = "per-layer",
                          page_bytes: int | None = None, cache_bytes: int | None = None,
                          kv_cache_dtype: str = "auto") -> "VMemCache":
        """A cache for an HF model config. ``dtype`` defaults to the config's (else float32) and
        must match the model's; ``page_bytes``/``cache_bytes`` as in ``runtime.kv.make_kv``
        (default budget: every slot at full length; default page: ``same_tokens_page_bytes``,
        as many tokens whatever the stored dtype); ``kv_cache_dtype``: how K/V are stored
        (``runtime.kv_dtype``; other than the model's dtype, update returns decoded copies).
        Refused (CacheConfigError, naming it): a config with ``use_cache=False`` or
        ``is_encoder_decoder`` (``support.check_generate_feeds_new_tokens``)."""
        cache = cls(cache_config_from_model(config, max_batch, max_context, dtype, device,
                                            kv_cache_dtype),
                    layout=layout, page_bytes=page_bytes, cache_bytes=cache_bytes)
        cache._bind_model(config)
        return cache

    def _bind_model(self, config) -> None:
        """Serve the model of HF ``config``: contiguous K/V for the families that need them,
        and the guard bound to it (its top writing layer; its attention checked). A copy of
        the cache is bound to the same config (``cache_copy.copy_cache``)."""
        self._model_config = config
        self._contiguous = needs_contiguous_kv(config)
        self._guard.bind_model(config)

    # -- what HF asks --
    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def max_context(self) -> int:
        return self.config.max_context
    max_cache_len = max_context     # transformers' name for it

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` (B, kv_heads, q, head_dim) after the cached tokens
        of ``layer_idx``; return all of them as (B, kv_heads, L, head_dim) views of the pool
        (``layers[i].keys`` too, as a StaticCache's are its buffers): kept past ``reset()``, they
        show the next batch's K/V (clone them). CacheStateError while another forward writes."""
        with self._guard.writing(layer_idx):
            return self._update(key_states, value_states, layer_idx, kwargs)

    def _update(self, key_states, value_states, layer_idx: int, call_kwargs: dict):
        self._check_open()
        check_layer_idx(layer_idx, self.config.num_layers)
        check_update_states(self.config, key_states, value_states, self._device)
        batch, _, new, _ = key_states.shape
        if layer_idx == 0 and batch == len(self._rows):   # a new batch: refused as such below
            check_forward_start(self._written, self._guard.top_layer, call_kwargs, new)
        start, end = self._written[layer_idx], self._written[layer_idx] + new
        slide = self._crop_bound_from(start) > self._slid_to     # memory to give back
        scales = self.kv.cache.kv_scales
        fixed = scales is not None and scales.fixed[layer_idx]
        with torch.no_grad():      # encoded first: a NonFiniteKVError leaves the cache as it was
            k_new, v_new = self.kv.cache.encode(layer_idx, key_states.transpose(1, 2),
                                                value_states.transpose(1, 2))
        claims = not self._rows
        try:
            if end > self._held() or claims or slide:
                self._advance(batch, start, end, slide)
            elif batch != len(self._rows):
                self._raise_batch_changed(batch)
            k_cache, v_cache = self.kv.layer_tensors(layer_idx)   # (max_batch, C, H, D)
            with torch.no_grad():
                k_cache[:batch, start:end].copy_(k_new)
                v_cache[:batch, start:end].copy_(v_new)
        except BaseException:          # as before: rows this write claimed go back, its scales
            if claims and self._rows:
                self._drop_rows()
            if scales is not None and not fixed:
                scales.unfix(layer_idx)
            raise
        self._written[layer_idx] = end
        layer = self.layers[layer_idx]
        first = window_offset(layer.window, start)      # a windowed layer: keys (p - window, p]
        k, v = self._values(layer_idx, k_cache[:batch, first:end], v_cache[:batch, first:end])
        layer.keys, layer.values = k.transpose(1, 2), v.transpose(1, 2)
        if self._contiguous and batch > 1:    # a family that views the keys (B*H, L, D)
            return layer.keys.contiguous(), layer.values.contiguous()
        return layer.keys, layer.values

    def _values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Stored K/V ``(B, L, H, D)`` as the model's dtype: the views themselves when stored so,
        else decoded copies (``kv_cache_dtype``)."""
        c, scales = self.config, self.kv.cache.kv_scales
        if scales is not None:
            k = c.kv_encoding.dequantize(k, scales.k[layer])
            v = c.kv_encoding.dequantize(v, scales.v[layer])
        return k.to(c.dtype), v.to(c.dtype)

    # -- growth through the manager --
    def _held(self) -> int:
        """Tokens the manager holds for every row (rows share one length)."""
        return self.manager.num_tokens(self._rows[0]) if self._rows else 0

    def _advance(self, batch: int, start: int, end: int, slide: bool) -> None:
        """A forward of queries ``[start, end)``: with ``slide``, give back every row's memory
        wholly behind the windowed layers' windows (as the scheduler does before a step), then
        make the manager hold ``end`` tokens in each of ``batch`` rows, and map the planned
        pages. One StepTransaction, all or nothing: a refused batch or length, a budget too
        small even after the give-back, or a page map that fails (PlanExecutionError) leaves
        manager, rows, memory and ``crop``'s bound as before, so the next call runs again."""
        bound = max(self._slid_to, self._crop_bound_from(start)) if slide else self._slid_to
        if self._rows and batch != len(self._rows):
            self._raise_batch_changed(batch)
        if batch > self.max_batch:
            raise BatchTooLargeError(f"batch of {batch} rows exceeds this cache's max_batch="
                                     f"{self.max_batch}")
        if end > self.max_context:
            raise ContextOverflowError(f"sequence length {end} exceeds this cache's max_context="
                                       f"{self.max_context} (batch of {batch} rows)")
        held = self._held()

        def advance() -> StepPlan:
            if slide:
                for seq_id in self._rows:
                    self.manager.release_behind_window(seq_id, start)
            need, free, unit = growth_room(self, batch, held, end)
            if need > free:
                raise CacheCapacityError(f"growing {batch} rows to {end} tokens needs {need} "
                                         f"{unit}; the cache_bytes budget has {free} left")
            if not self._rows:
                self._claim_rows(batch)
            for seq_id in self._rows if end > held else ():
                self.manager.append(seq_id, end - held)
            return self._plan()

        rows, next_id = self._rows, self._next_id
        with deferred_interrupts():   # a Ctrl-C lands once the window's bound is recorded
            self._txn.run(advance, lambda: self._put_rows(rows, next_id))
            self._slid_to = bound

    def _crop_bound_from(self, start: int) -> int:
        """``crop``'s bound once a forward from ``start`` gave back the rows' memory wholly
        behind the windowed layers' windows (the page boundary the manager unmaps)."""
        window = self.manager.window_tokens
        return crop_floor_tokens(window, given_back_tokens(window, self.kv.tokens_per_page,
                                                           start, self._held()))

    def _put_rows(self, rows: list, next_id: int) -> None:
        self._rows, self._next_id = rows, next_id

    def _plan(self, dropped=()) -> StepPlan:
        """This cache's plan: the manager's ops, then the rows' slots (``dropped`` forgotten)."""
        return StepPlan([], self.manager.take_ops(),
                        tables=self.kv.tables.edits(self.manager, self._rows, dropped))

    def _claim_rows(self, batch: int) -> None:
        """Hold slots 0..batch-1, one empty sequence each, row b on slot b (so
        ``k_cache[:batch]`` is the batch). Pages an earlier batch left mapped there are reused."""
        first, self._next_id = self._next_id, self._next_id + batch
        for row in range(batch):
            self.manager.allocate(first + row, 0, slot=row)
        self._rows = list(range(first, first + batch))

    def _raise_batch_changed(self, batch: int) -> None:
        raise CacheStateError(f"batch of {batch} rows, but this cache holds a batch of "
                              f"{len(self._rows)}; call reset() before a new batch")

    # -- HF hooks --
    def reset(self) -> None:
        """Drop every row (ready for a new batch), as a fresh cache would take it: 8-bit scales
        fixed by a first write are unfixed (given ones stay); pages stay mapped, for reuse."""
        self._check_open()
        self._drop_rows()
        self._guard.reset()
        self._written = [0] * self.config.num_layers
        self._slid_to = 0
        for layer in self.layers:
            layer.keys = layer.values = None
        if self.kv.cache.kv_scales is not None:
            self.kv.cache.kv_scales.unfix()

    def _drop_rows(self) -> None:
        """Free the rows (one StepTransaction); their pages stay mapped."""
        def free() -> StepPlan:
            for seq_id in self._rows:
                self.manager.free(seq_id)
            self._rows = []
            return self._plan(dropped=rows)

        rows, next_id = self._rows, self._next_id
        self._txn.run(free, lambda: self._put_rows(rows, next_id))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b takes the tokens of row ``beam_idx[b]`` (in place, every layer).
        Refused first: anything but one row in ``[0, batch)`` per row (``check_beam_index``)."""
        self._check_open()
        batch = len(self._rows)
        check_beam_index(beam_idx, batch)
        index = beam_idx.to(self._device)
        for layer, length in enumerate(self._written):
            # what a later forward may read: ``crop`` goes back as far as ``_slid_to``, and the
            # memory a query there reads is mapped (the give-back kept it)
            first = window_offset(self.layers[layer].window, min(self._slid_to, length))
            for cache in self.kv.layer_tensors(layer):
                rows = cache[:batch, first:length]
                rows.copy_(rows.index_select(0, index))
            if self.config.storage_dtype != self.config.dtype:   # decoded copies, not views
                self.layers[layer].reorder_copies(index)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens of every row (their pages stay held)."""
        self._check_open()
        check_crop_count(tokens_to_remove)
        written = [max(0, n + tokens_to_remove) for n in self._written]
        # layers that never write (Gemma 3n's KV-shared layers read another layer's) stay at 0
        kept = [n for n, before in zip(written, self._written) if before]
        if kept:
            check_crop_keeps_window(tokens_to_remove, min(kept), max(self._written),
                                    self._slid_to, self.manager.window_tokens)
        for layer, before, after in zip(self.layers, self._written, written):
            layer.forget_last(before - after)
        self._written = written

    def __deepcopy__(self, memo) -> "VMemCache":
        """A cache with memory of its own holding the same rows and pages, for transformers'
        prompt-reuse recipe (``copy.deepcopy`` of a filled cache): ``cache_copy.copy_cache``."""
        self._check_open()
        return copy_cache(self, memo)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheStateError("VMemCache holds one static batch; it cannot be expanded in place")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise CacheStateError("VMemCache holds one static batch; it cannot select rows in place")

    # -- memory report and lifecycle --
    def stats(self) -> VMemCacheStats:
        """Memory now. Raises CacheStateError after ``close()`` (nothing is held any more)."""
        self._check_open()
        c, tokens = self.config, self._written[0]
        return VMemCacheStats(batch=len(self._rows), seq_len=tokens,
                              mapped_pages=self.kv.range.num_mapped_pages,
                              page_bytes=self.kv.page_bytes,
                              live_bytes=len(self._rows) * tokens * c.bytes_per_token,
                              reserved_bytes=self.kv.range.size_bytes,
                              committed_bytes=self.kv.pool.committed_bytes,
                              budget_bytes=self.kv.pool.total_pages * self.kv.page_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("VMemCache used after close()")

    def close(self) -> None:
        """Unmap everything and release the pages; the cache cannot be used afterwards. Idempotent."""
        if not self._closed:
            self._closed = True
            for layer in self.layers:
                layer.keys = layer.values = None
            self.kv.close()

    def __enter__(self) -> "VMemCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats() if not self._closed else None
        state = "closed" if s is None else (f"batch={s.batch}, seq_len={s.seq_len}, "
                                            f"mapped_pages={s.mapped_pages}")
        return (f"VMemCache({self.kv.memory_layout}, max_batch={self.max_batch}, "
                f"max_context={self.max_context}, {state})")
