"""``cpu-varlen``: one native call per layer for the whole batch on the CPU, vmem and paged.

The kernel (``cpu_varlen.c``, built at first use by ``native.py``) takes the cache itself plus
per-request metadata and does what FlashAttention's varlen call does on a GPU::

    vmem   k_cache [max_batch, max_ctx, Hkv, D] (strided views welcome: interleaved layout)
           request i reads k_cache[slot_i, kv_start_i : ctx_i]   in place, no copy, no gather
    paged  k_pool [num_blocks, block_size, Hkv, D] + block table  (block-table aware: no gather)
           request i reads its first ceil(ctx_i / block_size) blocks, tokens kv_start_i .. ctx_i-1

The interleaved vmem layout's per-layer view (``k_all[:, :, layer]``, token rows ``layers x
Hkv x D`` elements apart) is read in place the same way: the kernel takes the view's strides.

Decode, prefill chunks and mixed batches go in the same call: every query row attends to keys
``[kv_start, its position]`` (bottom-right causal), on a sliding-window layer only the last
``window`` of them, with the layer's logit soft-cap applied to the scores. Grouped-query
attention shares each loaded K/V row among the G query heads of its KV head (nothing is
repeated): a prefill item holds up to 64 / G positions of one KV head, so 64 query rows share
each K/V row. Everything the call needs besides q is built once per step (the step's
``StepMeta`` memo) and reused by every layer.

``sdpa_above_tokens=N`` (default None: everything in the kernel) sends requests with more than
N query tokens to per-request SDPA instead, the path before the kernel ran prefill (kept to
time one against the other; measured in docs/attention.md). Exact either way.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from numbers import Integral
from typing import NamedTuple, Optional

import torch

from . import native
from .base import AttentionBackend, Availability
from .views import ALL_KV_DTYPES, PagedLayerView, VMemLayerView
from .errors import AttentionError, UnsupportedError
from .kv import attend_one, paged_kv, per_request, vmem_kv

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
               torch.float8_e5m2: 4, torch.int8: 5}   # cpu_varlen_math.h's DT_*
MAX_ROWS = 64              # query rows per work item in the kernel (positions x grouped heads)
SDPA_ABOVE_TOKENS = None   # every request in the kernel (prefill measured faster than SDPA)
SPLIT_MIN_KEYS = 256       # fewest keys in one split of a request's key range (4 tiles)


class CpuVarlenBackend(AttentionBackend):
    """The batch in one native call per layer: decodes, prefill chunks, windows, soft-caps.

    sdpa_above_tokens: requests with more query tokens than this run through per-request
    SDPA instead; ``None`` (the default) sends every request through the kernel.
    work_units: when a call has fewer work items than this (default: torch's thread count at
    the call), or up to 4x as many that do not share out evenly, each item's key range is split
    (flash-decoding: partial softmaxes merged exactly; see ``_with_splits``);
    ``split_min_keys`` is the fewest keys one split takes.
    Results are the same as unsplit up to fp32 rounding.
    """
    name = "cpu-varlen"
    max_query_heads_per_kv_head = MAX_ROWS   # a work item's rows
    devices = frozenset({"cpu"})
    kinds = frozenset({"vmem", "paged"})
    supports_kv_starts = True
    layer_features = frozenset({"window", "softcap"})   # both in the kernel
    kv_dtypes = ALL_KV_DTYPES   # K/V of any dtype read in place; 8-bit with the view's scales

    def __init__(self, sdpa_above_tokens: Optional[int] = SDPA_ABOVE_TOKENS,
                 work_units: Optional[int] = None, split_min_keys: int = SPLIT_MIN_KEYS) -> None:
        for option, value in (("sdpa_above_tokens", sdpa_above_tokens),
                              ("work_units", work_units), ("split_min_keys", split_min_keys)):
            if (value is not None or option == "split_min_keys") and (
                    isinstance(value, bool) or not isinstance(value, Integral) or value < 1):
                none = "" if option == "split_min_keys" else " or None"   # "3": a bare TypeError
                raise UnsupportedError(f"{option} must be >= 1{none}; got {value!r} "
                                       f"({type(value).__name__}, an int is needed)")
        self.sdpa_above_tokens = sdpa_above_tokens
        self.work_units, self.split_min_keys = work_units, split_min_keys

    @classmethod
    def available(cls) -> Availability:
        why = native.why_unavailable()
        return Availability(not why, why)

    def _forward_vmem(self, q, view: VMemLayerView, scale):
        return self._forward(q, view, scale, view.k_cache, view.v_cache, vmem_kv)

    def _forward_paged(self, q, view: PagedLayerView, scale):
        return self._forward(q, view, scale, view.k_pool, view.v_pool, paged_kv)

    def _forward(self, q, view, scale, k, v, kv_of):
        heads, kv_heads = q.shape[1], k.shape[2]
        if heads // kv_heads > MAX_ROWS:
            raise UnsupportedError(f"cpu-varlen takes at most {MAX_ROWS} query heads per KV head; "
                                   f"got {heads}/{kv_heads}")
        split = _Split(self.work_units or torch.get_num_threads(), self.split_min_keys)
        key = ("cpu-varlen", view.kv_starts, view.window, heads, kv_heads, self.sdpa_above_tokens, split)
        meta = view.memo(key, lambda: _Meta(view, kv_heads, heads // kv_heads,
                                            self.sdpa_above_tokens, split))
        out = torch.empty(q.shape, dtype=torch.float32)
        if meta.items.shape[0] and not _call(q.float().contiguous(), out, k, v, meta, scale, view):
            return per_request(q, view, scale)   # q x scale overflowed fp32 in the kernel: SDPA
        if not meta.sdpa_requests:
            return out if q.dtype == torch.float32 else out.to(q.dtype)
        out = out.to(q.dtype)
        for i in meta.sdpa_requests:   # the sdpa_above_tokens option: SDPA per prefill chunk
            start, n = view.lens.q_starts[i], view.lens.query_lens[i]
            kk, vv = kv_of(view, i)
            out[start:start + n] = attend_one(q[start:start + n], kk, vv, scale, False,
                                              view.window, view.softcap)
        return out


class _Meta:
    """One step's kernel arguments (host int64 tensors), shared by every layer."""

    def __init__(self, view, kv_heads: int, group: int, sdpa_above: Optional[int],
                 split: "_Split") -> None:
        lens = view.lens
        self.sdpa_requests = [i for i, n in enumerate(lens.query_lens)
                              if sdpa_above is not None and n > sdpa_above]
        items = _work_items(lens, view.kv_starts, set(self.sdpa_requests), kv_heads, group,
                            view.window)
        items = _with_splits(items, lens, view.kv_starts, split, view.window)
        self.items = torch.tensor(items, dtype=torch.int64).reshape(-1, 6)
        self.ctx = torch.tensor(lens.context_lens, dtype=torch.int64)
        self.qlen = torch.tensor(lens.query_lens, dtype=torch.int64)
        self.qstart = torch.tensor(lens.q_starts, dtype=torch.int64)
        self.kvstart = torch.tensor(view.kv_starts, dtype=torch.int64)
        if isinstance(view, VMemLayerView):
            self.slots, self.tables, width, block_size = (
                torch.tensor(view.host_slots, dtype=torch.int64), None, 0, 0)
        else:
            self.slots, self.tables = None, view.block_tables.to(torch.int64).contiguous()
            width, block_size = self.tables.shape[1], view.block_size
        # the kernel's per-step arguments as ctypes values, once per step (the tensors above
        # keep the memory alive)
        self.args = (_ptr(self.slots), _ptr(self.tables), width, block_size, _ptr(self.ctx),
                     _ptr(self.qlen), _ptr(self.qstart), _ptr(self.kvstart), _ptr(self.items),
                     self.items.shape[0])


def _work_items(lens, kv_starts, skip: set, kv_heads: int, group: int,
                window: Optional[int] = None) -> list:
    """(request, p0, np, h0, nh) per kernel work item, longest key range first (so dynamic
    scheduling ends on short items). Positions first: an item takes as many of a request's
    query positions as fit in MAX_ROWS rows of one KV head (a prefill chunk: 64 / G positions
    share each loaded K/V row), then as many KV heads as still fit, all of them for a decode
    of the usual GQA shapes, so a decode item reads whole token rows ``[Hkv, D]``
    sequentially (splitting a token row's heads across items to feed more threads made each
    item read part of every token row: measured 2-10x slower)."""
    items = []
    for i, n in enumerate(lens.query_lens):
        if i in skip:
            continue
        per_item = min(n, max(1, MAX_ROWS // group))             # query positions per item
        heads = min(kv_heads, max(1, MAX_ROWS // (group * per_item)))
        items += [(i, p0, min(per_item, n - p0), h, min(heads, kv_heads - h))
                  for p0 in range(0, n, per_item) for h in range(0, kv_heads, heads)]
    items.sort(key=lambda it: -_item_keys(lens, kv_starts, window, it))
    return items


def _item_keys(lens, kv_starts, window: Optional[int], item) -> int:
    """Keys an item (request i, p0, np, ...) reads: from its first key (kv_start or, on a
    windowed layer, its first row's window start; the kernel's item_lo) to its last row."""
    i, p0, n = item[:3]
    first_pos = lens.context_lens[i] - lens.query_lens[i] + p0
    first = kv_starts[i] if window is None else max(kv_starts[i], first_pos - window + 1)
    return first_pos + n - first


def _splits_wanted(num_items: int, units: int) -> int:
    """Splits per item so that ``num_items`` items feed ``units`` threads (see _with_splits)."""
    if not num_items or num_items >= 4 * units or num_items % units == 0:
        return 1
    want = -(-units // num_items)
    while num_items >= units and want < units:
        total = num_items * want       # work units; threads' rounds: ceil(total / units)
        if -(-total // units) * units <= 1.1 * total:
            break
        want += 1
    return want


class _Split(NamedTuple):
    """How items' key ranges are split: to feed ``units`` threads, in splits of >= min_keys."""
    units: int
    min_keys: int


def _with_splits(items: list, lens, kv_starts, split: _Split, window: Optional[int] = None) -> list:
    """Each item with its number of key-range splits appended: ceil(units / items) below
    ``split.units`` items; from units to 4 x units items, when they do not share out evenly
    (3 items on 2 threads leave one idle a third of the time), the fewest splits that leave
    at most 10% of the threads' rounds idle (3 items on 2 units: 2 each, 6 units); else 1.
    Fewer where the item's key range (``_item_keys``) would give a split under
    ``split.min_keys`` keys."""
    want = _splits_wanted(len(items), split.units)
    if want == 1:
        return [it + (1,) for it in items]
    out = []
    for item in items:
        keys = _item_keys(lens, kv_starts, window, item)
        out.append(item + (max(1, min(want, keys // split.min_keys)),))
    return out


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


@lru_cache(maxsize=64)
def _strides(stride: tuple) -> tuple:
    """(tensor, pointer) of a cache's first three element strides; one per distinct layout."""
    t = torch.tensor(stride[:3], dtype=torch.int64)
    return t, _ptr(t)


def _call(q: torch.Tensor, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          meta: _Meta, scale: float, view) -> bool:
    """One kernel call; q and out fp32 contiguous [T, H, D] (out written in place); the layer's
    window, soft-cap (0: none) and 8-bit K/V's scales (fp32 [Hkv], checked by the view) from
    ``view``. False when a finite query times the scale (and K's) overflowed fp32 (the kernel
    folds the scale into q: scale 3e38 with a soft-cap gave NaN rows where (q . k) * scale is
    finite); ``out`` is then garbage and the caller recomputes the call."""
    _, _, kv_heads, head_dim = k.shape
    dtype_code = DTYPE_CODES[k.dtype]
    rc = native.kernel(head_dim, dtype_code)(
        _ptr(q), _ptr(out), _ptr(k), _ptr(v), dtype_code,
        _ptr(view.k_scale), _ptr(view.v_scale), _strides(k.stride())[1],
        _strides(v.stride())[1], *meta.args, q.shape[1], kv_heads, head_dim, scale,
        view.window or 0, view.softcap or 0.0, torch.get_num_threads())
    if rc == -2:
        raise AttentionError(f"cpu-varlen: the kernel built for another shape was called for "
                             f"head_dim={head_dim}, {k.dtype} (a dispatch bug)")
    if rc == -3:
        return False
    if rc:
        raise MemoryError("cpu-varlen: the kernel could not allocate its scratch memory")
    return True
