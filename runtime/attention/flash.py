"""``flash``: PyTorch's built-in FlashAttention-2 kernels, CUDA only, fp16/bf16, unmodified.

One FA2 varlen call per layer for the whole batch (decode, prefill chunks or a mix), with
per-sequence K lengths (``seqused_k``) and FA2's causal mask, which is bottom-right aligned
(PyTorch's SDPA refuses non-square causal on its flash path for exactly that reason):

vmem
    the cache itself, viewed as packed sequences, one per slot::

        k_cache [max_batch, max_ctx, Hkv, D]  --as_strided-->  [max_batch*max_ctx, Hkv, D]
        cu_seq_k[i] = slot_i * max_ctx   (requests sorted by slot, so it is monotone)
        seqused_k[i] = context_len_i     (the kernel reads keys [cu_seq_k[i], +seqused_k[i]))
        cu_seq_q: the requests' query rows, in the same slot order

paged
    ``varlen_attn(..., block_table=, seqused_k=)`` when torch has it and the block size is a
    multiple of 256 (FA2's paged-KV constraint); else one gather of every request's used
    blocks (request after request, one index_select per pool) and the same one-call kernel,
    ``cu_seq_k`` at each request's first gathered block, ``seqused_k`` = its context length.

The kernel: ``varlen_attn(seqused_k=)`` where torch has that argument (2.12+); else the operator
varlen_attn wraps, ``torch.ops.aten._flash_attention_forward``, whose schema has carried
``seqused_k`` since torch 2.5 (FA2 handles GQA natively there). Without either (torch < 2.5) it
falls back to SDPA forced to the flash kernel per request (vmem: ``k_cache[slot, :ctx]`` in
place; paged: a gather per request), bottom-right causal via ``causal_lower_right``. Each
choice other than varlen_attn is said once, as a warning.

Sliding-window layers: each request's keys start at its ``kv_start`` (vmem: ``cu_seq_k`` moves
to ``slot * max_ctx + kv_start``; paged: the gather or block table starts at block
``kv_start // block_size``), ``seqused_k`` counts from there, and FA2's
``window_size = (window - 1, 0)`` (``window_size_left`` on the operator) masks exactly
transformers' window, keys (p - window, p], bottom-right aligned like its causal mask. A layer
with a logit soft-cap runs per request (the soft-capped math in ``kv``): neither kernel here
takes a soft-cap.

torch versions (see docs/attention.md): varlen_attn first shipped in 2.10 (causal via
``is_causal``, later ``window_size=(-1, 0)``); ``seqused_k``, ``block_table``, ``enable_gqa``
and ``num_splits`` landed on main in March 2026 (pytorch#175897, #175924) and are in the 2.12
docs, so torch 2.11 takes the aten operator. Detection is by signature and operator schema,
never by version number.
"""
from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Callable, Optional

import torch

from .base import AttentionBackend, Availability

from .views import PagedLayerView, VMemLayerView
from .errors import UnsupportedError
from .kv import per_request

log = logging.getLogger(__name__)
FA2_PAGED_BLOCK_MULTIPLE = 256
_warned: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)


@dataclass(frozen=True)
class VarlenCaps:
    """What the installed ``torch.nn.attention.varlen.varlen_attn`` accepts (by signature)."""
    fn: Optional[Callable]
    params: frozenset[str]
    why_missing: str = ""

    @property
    def seqused_k(self) -> bool:
        return "seqused_k" in self.params

    @property
    def block_table(self) -> bool:
        return "block_table" in self.params and self.seqused_k

    def gqa_ok(self, heads: int, kv_heads: int) -> bool:
        return heads == kv_heads or "enable_gqa" in self.params


@lru_cache(maxsize=1)
def aten_flash_args() -> frozenset[str]:
    """Argument names of ``torch.ops.aten._flash_attention_forward`` (empty if this torch has
    no such op). Read from the operator schema, so no CUDA is needed to ask."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(argument.name for argument in schema.arguments)


@lru_cache(maxsize=1)
def varlen_caps() -> VarlenCaps:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return VarlenCaps(None, frozenset(), f"torch {torch.__version__} has no "
                          f"torch.nn.attention.varlen ({e}); it first shipped in torch 2.10")
    return VarlenCaps(varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))


def call_varlen(caps: VarlenCaps, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                causal: bool, gqa: bool, window: Optional[int] = None, **extra) -> torch.Tensor:
    """varlen_attn with whichever spelling of scale / causal / GQA the installed torch has;
    a sliding ``window`` becomes ``window_size=(window - 1, 0)`` (causal with a window)."""
    kw = dict(extra)
    if "scale" in caps.params:
        kw["scale"] = scale
    else:  # no scale argument: the kernel uses 1/sqrt(D), so fold the ratio into q
        q = q * (scale * q.shape[-1] ** 0.5)
    if window is not None:
        if "window_size" not in caps.params:
            raise UnsupportedError(f"torch {torch.__version__} varlen_attn has no window_size "
                                   f"argument for a sliding window of {window} tokens")
        kw["window_size"] = (window - 1, 0)
    elif causal:  # FA2's causal mask is bottom-right aligned, as we need
        if "window_size" in caps.params:
            kw["window_size"] = (-1, 0)
        else:
            kw["is_causal"] = True
    if gqa:
        kw["enable_gqa"] = True
    return caps.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _flash_ctx():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _packed_view(cache: torch.Tensor) -> Optional[torch.Tensor]:
    """``[B, C, Hkv, D]`` -> ``[B*C, Hkv, D]`` view (no copy) when batch rows are evenly spaced."""
    b, c, h, d = cache.shape
    if cache.stride(0) != c * cache.stride(1):
        return None
    return cache.as_strided((b * c, h, d), (cache.stride(1), cache.stride(2), 1),
                            cache.storage_offset())


class FlashBackend(AttentionBackend):
    """FlashAttention-2 as shipped inside PyTorch (SDPA flash kernel and varlen_attn).

    paged_mode: "auto" (block table when possible, else gather), "block_table" (raise
    :class:`UnsupportedError` if it is not possible), or "gather".
    """
    name = "flash"
    devices = frozenset({"cuda"})
    kinds = frozenset({"vmem", "paged"})
    dtypes = frozenset({torch.float16, torch.bfloat16})
    layer_features = frozenset({"window", "softcap"})   # soft-capped layers run per request

    def __init__(self, paged_mode: str = "auto") -> None:
        if paged_mode not in ("auto", "block_table", "gather"):
            raise UnsupportedError(f"paged_mode must be auto, block_table or gather; got {paged_mode!r}")
        self.paged_mode = paged_mode

    @classmethod
    def available(cls) -> Availability:
        if not torch.cuda.is_available():
            return Availability(False, "CUDA is not available (flash runs on NVIDIA GPUs only)")
        if not torch.backends.cuda.is_flash_attention_available():
            return Availability(False, f"torch {torch.__version__} was built without flash attention")
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return Availability(False, f"FlashAttention-2 needs sm80+, this GPU is sm{major}{minor}")
        return Availability(True)

    # ---- vmem ---------------------------------------------------------------------------
    def _forward_vmem(self, q, view: VMemLayerView, scale):
        if view.softcap is not None:
            return self._softcapped(q, view, scale)
        kernel, why_not = self._one_call_kernel(q, view.kv_heads)
        why_not = why_not if kernel is None else self._packing_blocker(view)
        if not why_not:
            return self._packed_call(q, view, scale, kernel)
        warn_once(f"flash: vmem attention falls back to one SDPA-flash call per request: {why_not}")
        with _flash_ctx():
            return per_request(q, view, scale, causal_bias=True)

    @staticmethod
    def _softcapped(q, view, scale):
        warn_once(f"flash: layers with a logit soft-cap ({view.softcap}) run per request on "
                  f"soft-capped math: the FA2 kernels torch ships take no soft-cap")
        return per_request(q, view, scale)

    def _one_call_kernel(self, q, kv_heads: int):
        """(kernel, "") for attention over the whole batch in one FA2 varlen call with
        per-sequence K lengths, or (None, why not). ``varlen_attn(seqused_k=)`` first; else the
        operator it wraps, ``aten._flash_attention_forward(seqused_k=)``, saying once that it
        goes there. ``kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, seqused_k, causal,
        [window=])``."""
        caps = varlen_caps()
        if caps.fn is None:
            why_not_varlen = caps.why_missing
        elif not caps.seqused_k:
            why_not_varlen = (f"torch {torch.__version__} varlen_attn has no seqused_k argument "
                              f"(added to PyTorch main in March 2026, pytorch#175897; first "
                              f"documented in 2.12)")
        elif not caps.gqa_ok(q.shape[1], kv_heads):
            why_not_varlen = (f"torch {torch.__version__} varlen_attn has no enable_gqa for "
                              f"{q.shape[1]}/{kv_heads} heads")
        else:
            return self._varlen_kernel, ""
        if "seqused_k" not in aten_flash_args():
            return None, (f"{why_not_varlen}; torch {torch.__version__} has no "
                          f"aten._flash_attention_forward with seqused_k (it has had one since 2.5)")
        warn_once("flash: attention calls aten._flash_attention_forward(seqused_k=) directly, "
                  f"as varlen_attn cannot: {why_not_varlen}")
        return self._aten_kernel, ""

    @staticmethod
    def _packing_blocker(view: VMemLayerView) -> str:
        if _packed_view(view.k_cache) is None or _packed_view(view.v_cache) is None:
            return f"cache strides {view.k_cache.stride()} do not flatten to packed sequences"
        return ""

    def _packed_call(self, q, view: VMemLayerView, scale, kernel):
        """The whole batch (decode, prefill or mixed) in one kernel call over the cache viewed
        as packed sequences, one per slot.

        Requests are sorted by slot so ``cu_seq_k`` is monotone; their query rows follow the
        sort and the outputs are put back in the caller's order. Causal masking is FA2's,
        bottom-right aligned to ``seqused_k`` (a decode batch needs none).
        """
        kp, vp = _packed_view(view.k_cache), _packed_view(view.v_cache)
        cu_q, cu_k, used, rows, max_q, max_k = view.memo(
            ("flash.packed", q.device, view.window), lambda: _packed_metadata(view, q.device))
        causal, extra = not view.lens.is_decode, _window_arg(view)
        if rows is None:                              # already in slot order: no shuffle
            return kernel(q, kp, vp, cu_q, cu_k, max_q, max_k, scale, used, causal, **extra)
        out = torch.empty_like(q)
        out[rows] = kernel(q.index_select(0, rows), kp, vp, cu_q, cu_k, max_q, max_k, scale,
                           used, causal, **extra)
        return out

    @staticmethod
    def _varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, used, causal, window=None):
        return call_varlen(varlen_caps(), q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=causal,
                           gqa=q.shape[1] != k.shape[1], window=window, seqused_k=used)

    @staticmethod
    def _aten_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, used, causal, window=None):
        # positional: dropout_p 0, is_causal (FA2: bottom-right), no debug mask; a window keeps
        # keys (p - window, p]: window_size_left = window - 1 (FA2 sets the right edge to 0)
        sliding = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal or window is not None, False,
            scale=scale, seqused_k=used, **sliding)[0]

    # ---- paged --------------------------------------------------------------------------
    def _forward_paged(self, q, view: PagedLayerView, scale):
        if view.softcap is not None:
            return self._softcapped(q, view, scale)
        reason = self._block_table_blocker(q, view)
        if self.paged_mode == "block_table" and reason:
            raise UnsupportedError(f"flash paged_mode='block_table' is not possible: {reason}")
        if self.paged_mode != "gather" and not reason:
            return self._varlen_paged(q, view, scale)
        kernel, why_not = self._one_call_kernel(q, view.kv_heads)
        if kernel is not None:
            if self.paged_mode == "auto":
                warn_once(f"flash: paged attention gathers the batch's blocks in one copy and "
                          f"makes one kernel call: {reason}")
            return self._gathered_call(q, view, scale, kernel)
        if self.paged_mode == "auto":
            warn_once(f"flash: paged attention gathers blocks per request: {reason}; {why_not}")
        with _flash_ctx():
            return per_request(q, view, scale, causal_bias=True)

    def _gathered_call(self, q, view: PagedLayerView, scale, kernel):
        """Gather every request's used blocks with one index_select per pool (request after
        request), then one kernel call: request i's keys start at its first gathered block and
        ``seqused_k[i]`` = its context length (the tail of its last block is never read)."""
        ids, cu_q, cu_k, used, max_k = view.memo(("flash.gather", q.device, view.window),
                                                 lambda: _gather_metadata(view, q.device))
        _, bs, hkv, d = view.k_pool.shape
        k = view.k_pool.index_select(0, ids).view(-1, hkv, d)
        v = view.v_pool.index_select(0, ids).view(-1, hkv, d)
        lens = view.lens
        return kernel(q, k, v, cu_q, cu_k, max(lens.query_lens), max_k, scale,
                      used, not lens.is_decode, **_window_arg(view))

    def _block_table_blocker(self, q, view: PagedLayerView) -> str:
        caps = varlen_caps()
        if caps.fn is None:
            return caps.why_missing
        if not caps.block_table:
            return f"torch {torch.__version__} varlen_attn has no block_table/seqused_k arguments"
        if view.block_size % FA2_PAGED_BLOCK_MULTIPLE:
            return (f"FA2 paged KV needs block_size to be a multiple of "
                    f"{FA2_PAGED_BLOCK_MULTIPLE}, got {view.block_size}")
        if not caps.gqa_ok(q.shape[1], view.kv_heads):
            return f"varlen_attn has no enable_gqa for {q.shape[1]}/{view.kv_heads} heads"
        return ""

    def _varlen_paged(self, q, view: PagedLayerView, scale):
        lens = view.lens
        cu_q, cu_k, used, table, max_k = view.memo(
            ("flash.varlen_paged", q.device, view.window),
            lambda: _varlen_paged_metadata(view, q.device))
        return call_varlen(varlen_caps(), q, view.k_pool, view.v_pool, cu_q, cu_k,
                           max(lens.query_lens), max_k, scale, causal=True,
                           gqa=q.shape[1] != view.kv_heads, window=view.window, seqused_k=used,
                           block_table=table)


# ---- per-step metadata: built at the first layer of a step, reused by the others ----------
def _window_arg(view) -> dict:
    return {} if view.window is None else {"window": view.window}


def _int32(values, dev) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=dev)


def _packed_metadata(view: VMemLayerView, dev) -> tuple:
    """(cu_q, cu_k, seqused_k, rows or None, max_q, max_k) of the packed vmem call: requests in
    slot order (so cu_k is monotone); ``rows`` permutes q into that order (None: no need).
    Request i's keys start at ``slot * max_ctx + kv_start`` and ``seqused_k = ctx - kv_start``."""
    mc, lens, host_slots = view.max_context, view.lens, view.host_slots
    order = sorted(range(len(host_slots)), key=host_slots.__getitem__)
    slots = [host_slots[i] for i in order]
    starts = [view.kv_starts[i] for i in order]
    ctx = [lens.context_lens[i] - view.kv_starts[i] for i in order]
    qlen = [lens.query_lens[i] for i in order]
    cu_k = _int32([s * mc + k for s, k in zip(slots, starts)] + [(slots[-1] + 1) * mc], dev)
    cu_q = _int32(accumulate(qlen, initial=0), dev)
    rows = None
    if order != sorted(order):
        rows = torch.tensor([r for i in order for r in range(lens.q_starts[i],
                                                             lens.q_starts[i] + lens.query_lens[i])],
                            device=dev)
    return cu_q, cu_k, _int32(ctx, dev), rows, max(qlen), max(ctx)


def _read_tables(view: PagedLayerView) -> list:
    """Every request's block ids this layer reads (from ``first_block_of(i)`` to its last used
    one), from the host copy of the tables when the cache gave one (no device read), else read
    once from the device."""
    meta = view.meta
    tables = meta.host_tables if meta is not None and meta.host_tables is not None else \
        [row[:view.num_blocks_of(i)] for i, row in enumerate(view.block_tables.tolist())]
    return [list(t[view.first_block_of(i):]) for i, t in enumerate(tables)]


def _used_block_ids(view: PagedLayerView) -> list:
    """Every request's read block ids, request after request (see ``_read_tables``)."""
    return [b for table in _read_tables(view) for b in table]


def _read_lens(view: PagedLayerView) -> list:
    """Per request, the keys from its first read block to its context length (``seqused_k``;
    the window mask hides the head of the first block that lies before ``kv_start``)."""
    bs = view.block_size
    return [c - view.first_block_of(i) * bs for i, c in enumerate(view.lens.context_lens)]


def _gather_metadata(view: PagedLayerView, dev) -> tuple:
    """(ids, cu_q, cu_k, seqused_k, max_k) of the gathered paged call: request i's keys start at
    its first gathered block and ``seqused_k[i]`` counts from there to its context length."""
    lens, bs = view.lens, view.block_size
    tables = _read_tables(view)
    ids = torch.tensor([b for t in tables for b in t], dtype=torch.long, device=dev)
    cu_k = _int32(accumulate((len(t) * bs for t in tables), initial=0), dev)
    cu_q = _int32(list(lens.q_starts) + [lens.total_query_tokens], dev)
    used = _read_lens(view)
    return ids, cu_q, cu_k, _int32(used, dev), max(used)


def _varlen_paged_metadata(view: PagedLayerView, dev) -> tuple:
    """(cu_q, cu_k, seqused_k, block_table, max_k): on a windowed layer each row of the table
    starts at the request's first read block (rows padded with 0, never read)."""
    lens, used = view.lens, _read_lens(view)
    cu_q = _int32(list(lens.q_starts) + [lens.total_query_tokens], dev)
    cu_k = _int32(accumulate(used, initial=0), dev)
    if view.window is None:
        table = view.block_tables.to(torch.int32)
    else:
        rows = _read_tables(view)
        width = max(len(r) for r in rows)
        table = _int32([b for r in rows for b in r + [0] * (width - len(r))], dev).view(len(rows), width)
    return cu_q, cu_k, _int32(used, dev), table, max(used)
