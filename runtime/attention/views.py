"""What a KV cache hands an attention backend for one layer: a step's lengths and a layer view.

Query packing (both cache kinds). ``q`` is ``[total_query_tokens, num_heads, head_dim]``; request i
owns rows ``q_start[i] : q_start[i] + query_lens[i]``, which are its positions
``context_lens[i] - query_lens[i] ... context_lens[i] - 1``. Each query sees the whole cached
prefix and, causally, the queries before it (bottom-right aligned causal mask):

    keys  0 ............ ctx-q  ...... ctx-1
    query ctx-q           x
    query ctx-q+1         x  x
    query ctx-1           x  x  ....... x        (decode: q == 1, one row that sees all keys)

Key starts: request i's queries see only keys ``kv_starts[i] : context_len``. A layer view's
``kv_starts`` is the later of the step's explicit starts (``BatchLens.kv_starts``, default 0;
backends that cannot honour a non-zero one refuse it, ``supports_kv_starts``) and the layer's
sliding window. Sliding-window layers (``view.window = W``): a query at position p sees keys
(p - W, p], as transformers' ``sliding_window_overlay`` defines it (``kv_idx > q_idx - W``).
Request i's earliest query is ``context_len - query_len``, so the layer reads keys from
``max(0, context_len - query_len - W + 1)``; 0 on full-attention layers.

Memory-safety contract: a backend reads ``k_cache[slot, kv_start:context_len]`` (vmem) or the
block-table entries ``kv_start // block_size .. ceil(context_len / block_size) - 1`` (paged)
and nothing else. Memory past ``context_len`` may be unmapped (reading it faults), so may memory
before ``kv_start`` (a windowed layer's pages behind the window), and other slots may hold stale
data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar, NamedTuple, Optional, Union

import torch

from vmemkv.scheduler.layout import CacheKind

from .checks import (check_cache_pair, check_int_tensor, check_query, check_scalars, host_ints,
                     packed_starts)
from .errors import AttentionShapeError

SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# every K/V storage dtype a cache may hold (runtime/kv_dtype.py): 8-bit ones come with scales
ALL_KV_DTYPES = SUPPORTED_DTYPES | {torch.float8_e4m3fn, torch.float8_e5m2, torch.int8}


class BatchLens(NamedTuple):
    """Host-side (Python int) copies of the per-request metadata, read once per step.

    The cache may build one and share it across layers so a GPU step syncs once, not per layer.
    """
    context_lens: tuple[int, ...]   # tokens cached per request, this step's included
    query_lens: tuple[int, ...]     # new query tokens per request
    q_starts: tuple[int, ...]       # first row of each request in packed q
    kv_starts: tuple[int, ...] = ()  # first key each request sees; () means 0 for every one

    @classmethod
    def from_tensors(cls, context_lens: torch.Tensor, query_lens: torch.Tensor,
                     kv_starts=()) -> "BatchLens":
        ctx = tuple(int(x) for x in host_ints(context_lens, "context_lens"))
        ql = tuple(int(x) for x in host_ints(query_lens, "query_lens"))
        return cls(ctx, ql, packed_starts(ql), tuple(int(s) for s in kv_starts))

    @property
    def total_query_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """True when every request has exactly one query token."""
        return all(n == 1 for n in self.query_lens)

    @property
    def key_starts(self) -> tuple[int, ...]:
        """``kv_starts`` with the default filled in: one int per request."""
        return self.kv_starts or (0,) * len(self.context_lens)

    @property
    def has_kv_starts(self) -> bool:
        """True when some request starts its keys after position 0."""
        return any(self.kv_starts)


def window_starts(lens: BatchLens, window: Optional[int]) -> tuple[int, ...]:
    """Per request, the first key position a layer may read this step: the step's explicit
    start (``lens.key_starts``) or, with a sliding ``window``, ``max(0, context_len - query_len
    - window + 1)``, whichever is later."""
    if window is None:
        return lens.key_starts
    return tuple(max(k, c - q - window + 1) for k, c, q in
                 zip(lens.key_starts, lens.context_lens, lens.query_lens))


class StepMeta:
    """One step's metadata, shared by the views of every layer: host copies of the lens (and
    of the slots or block tables), and a memo of what backends derive from them (device
    tensors, a validation). Built once per step by the cache, so the first layer pays for it
    and the others reuse it: a GPU step copies metadata to the device once, not per layer."""

    def __init__(self, lens: BatchLens, host_slots: Optional[tuple] = None,
                 host_tables: Optional[tuple] = None) -> None:
        self.lens = lens
        self.host_slots = host_slots       # vmem: slot per request
        self.host_tables = host_tables     # paged: block ids per request (used entries)
        self._memo: dict = {}

    def memo(self, key, build):
        """``build()`` the first time ``key`` is asked for in this step, the stored value after."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = build()
            return value


class _StepData:
    """``lens`` and ``memo`` of a view: from its StepMeta when the cache gave one, else read
    from the device tensors once per view (a view built by hand)."""
    meta: Optional[StepMeta]
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    window: Optional[int]
    softcap: Optional[float]

    @cached_property
    def lens(self) -> BatchLens:
        if self.meta is not None:
            return self.meta.lens
        return BatchLens.from_tensors(self.context_lens, self.query_lens)

    @cached_property
    def kv_starts(self) -> tuple[int, ...]:
        """Per request, the first key position this layer reads (see ``window_starts``)."""
        return window_starts(self.lens, self.window)

    def decode(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """K and V slices ``[..., kv_heads, head_dim]`` of this view's cache as values: fp32
        ``stored * scale`` for an 8-bit cache, unchanged otherwise."""
        if self.k_scale is None:
            return k, v
        return k.float() * self.k_scale.unsqueeze(-1), v.float() * self.v_scale.unsqueeze(-1)

    @cached_property
    def _own_meta(self) -> StepMeta:
        return self.meta if self.meta is not None else StepMeta(self.lens)

    def memo(self, key, build):
        """Per-step memo (per view when the view has no StepMeta)."""
        return self._own_meta.memo(key, build)

    @property
    def kv_heads(self) -> int:
        """KV heads of the layer: dimension 2 of its cache, [slots or blocks, tokens, heads, D]."""
        return self._cache_tensor().shape[2]

    def validate(self, q: torch.Tensor) -> None:
        """Raise :class:`AttentionShapeError` unless q, caches and metadata fit together; each
        distinct shape is checked once per step."""
        _check_layer_features(self.window, self.softcap)
        k, v = self._cache_pair()
        _check_scales(k, self.k_scale, self.v_scale)
        key = ("validated", tuple(q.shape), q.dtype, q.device, tuple(k.shape), k.stride(), k.dtype,
               tuple(v.shape), v.stride(), v.dtype)
        self.memo(key, lambda: self._validate(q) or True)


@dataclass(frozen=True)
class VMemLayerView(_StepData):
    """One layer of a vmem cache: each request's K/V are contiguous rows of one batch slot.

    k_cache, v_cache: ``[max_batch, max_context, kv_heads, head_dim]``, last dim contiguous,
        possibly strided (interleaved layout: ``k_all[:, :, layer]``). Never read whole.
    slots: int64 ``[batch]``, the batch row each request owns.
    context_lens, query_lens: ``[batch]`` ints, see the module docstring.
    meta: the step's :class:`StepMeta` (the cache passes one); absent, read from the tensors.
    window, softcap: how this layer attends (sliding window in tokens; logit soft-cap), None
        for plain causal attention over every cached token.
    k_scale, v_scale: an 8-bit cache's per-KV-head fp32 scales (the values are stored * scale,
        ``runtime.kv_dtype``); None for a cache in a 16/32-bit dtype.
    """
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    meta: Optional[StepMeta] = field(default=None, compare=False)
    window: Optional[int] = None      # sliding window in tokens (None: full attention)
    softcap: Optional[float] = None   # attention logit soft-cap: scores -> cap * tanh(scores / cap)
    k_scale: Optional[torch.Tensor] = field(default=None, compare=False)   # 8-bit K/V: fp32
    v_scale: Optional[torch.Tensor] = field(default=None, compare=False)   # [kv_heads] each
    kind: ClassVar[CacheKind] = CacheKind.VMEM

    @cached_property
    def host_slots(self) -> tuple[int, ...]:
        if self.meta is not None and self.meta.host_slots is not None:
            return self.meta.host_slots
        return tuple(int(s) for s in host_ints(self.slots, "slots"))

    def _cache_tensor(self) -> torch.Tensor:
        return self.k_cache

    def _cache_pair(self) -> tuple:
        return self.k_cache, self.v_cache

    @property
    def max_context(self) -> int:
        return self.k_cache.shape[1]

    def _validate(self, q: torch.Tensor) -> None:
        check_cache_pair(self.k_cache, self.v_cache, "k_cache", "v_cache")
        check_query(q, self.k_cache, self.lens, self.slots.shape, "slots")
        max_batch, max_ctx = self.k_cache.shape[:2]
        bad = [s for s in self.host_slots if not 0 <= s < max_batch]
        if bad or len(set(self.host_slots)) != len(self.host_slots):
            raise AttentionShapeError(
                f"slots {list(self.host_slots)} must be distinct and in [0, {max_batch}) "
                f"for k_cache of shape {tuple(self.k_cache.shape)}")
        if max(self.lens.context_lens, default=0) > max_ctx:
            raise AttentionShapeError(
                f"context_lens {list(self.lens.context_lens)} exceed max_context {max_ctx} "
                f"of k_cache {tuple(self.k_cache.shape)}")


@dataclass(frozen=True)
class PagedLayerView(_StepData):
    """One layer of a paged cache: K/V live in fixed-size blocks named by a block table.

    k_pool, v_pool: ``[num_blocks, block_size, kv_heads, head_dim]``.
    block_tables: int32 ``[batch, max_blocks_per_seq]``; only the first
        ``ceil(context_len / block_size)`` entries of a row are meaningful (the rest: anything;
        on a windowed layer the entries before ``kv_start // block_size`` too).
    context_lens, query_lens, meta, window, softcap, k_scale, v_scale: as in
        :class:`VMemLayerView`.
    """
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    meta: Optional[StepMeta] = field(default=None, compare=False)
    window: Optional[int] = None
    softcap: Optional[float] = None
    k_scale: Optional[torch.Tensor] = field(default=None, compare=False)
    v_scale: Optional[torch.Tensor] = field(default=None, compare=False)
    kind: ClassVar[CacheKind] = CacheKind.PAGED

    def _cache_tensor(self) -> torch.Tensor:
        return self.k_pool

    def _cache_pair(self) -> tuple:
        return self.k_pool, self.v_pool

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[1]

    def num_blocks_of(self, i: int) -> int:
        """Block-table entries request i actually uses: ceil(context_len / block_size)."""
        return math.ceil(self.lens.context_lens[i] / self.block_size)

    def first_block_of(self, i: int) -> int:
        """The first block-table entry request i reads at this layer: kv_start // block_size."""
        return self.kv_starts[i] // self.block_size

    def _validate(self, q: torch.Tensor) -> None:
        check_cache_pair(self.k_pool, self.v_pool, "k_pool", "v_pool")
        check_query(q, self.k_pool, self.lens, self.block_tables.shape[:1], "block_tables")
        bt = self.block_tables
        check_int_tensor(bt, "block_tables")
        if bt.dim() != 2:
            raise AttentionShapeError(f"block_tables must be [batch, max_blocks], got {tuple(bt.shape)}")
        need = max((self.num_blocks_of(i) for i in range(len(self.lens.context_lens))), default=0)
        if need > bt.shape[1]:
            raise AttentionShapeError(
                f"context_lens {list(self.lens.context_lens)} need {need} blocks of "
                f"{self.block_size} tokens but block_tables is {tuple(bt.shape)}")
        if bt.device.type == "cpu":  # range check is free on the host; on GPU it would sync
            used = [bt[i, self.first_block_of(i):self.num_blocks_of(i)] for i in range(bt.shape[0])]
            ids = torch.cat(used) if used else bt.new_zeros(0)
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.k_pool.shape[0]):
                raise AttentionShapeError(
                    f"block ids must be in [0, {self.k_pool.shape[0]}) for k_pool "
                    f"{tuple(self.k_pool.shape)}; got range [{int(ids.min())}, {int(ids.max())}]")


LayerView = Union[VMemLayerView, PagedLayerView]


def _check_layer_features(window, softcap) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise AttentionShapeError(f"a layer's sliding window must be an int >= 1 or None, got {window!r}")
    if softcap is not None:
        check_scalars(1.0, softcap)


def _check_scales(k: torch.Tensor, k_scale, v_scale) -> None:
    """An 8-bit cache comes with fp32 scales of one entry per KV head; no other does."""
    scaled = k.dtype not in SUPPORTED_DTYPES
    if not scaled:
        if k_scale is not None or v_scale is not None:
            raise AttentionShapeError(f"k_scale / v_scale are for 8-bit caches; this one is {k.dtype}")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != (k.shape[2],) \
                or s.device != k.device or not s.is_contiguous():
            raise AttentionShapeError(
                f"a {k.dtype} cache needs {name} fp32 [{k.shape[2]}] (one per KV head) on "
                f"{k.device}; got {None if s is None else (s.dtype, tuple(s.shape), s.device)}")
