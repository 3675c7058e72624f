"""``flash``: PyTorch's built-in FlashAttention-2 kernels, CUDA only, fp16/bf16, unmodified.

vmem
  * prefill / mixed batches: SDPA forced to the flash kernel on each request's
    ``k_cache[slot, :ctx]`` view in place, bottom-right causal via ``causal_lower_right``.
  * batched decode: ONE ``varlen_attn`` call over the whole cache viewed as packed sequences,
    one per slot, when the installed torch's varlen_attn has ``seqused_k``::

        k_cache [max_batch, max_ctx, Hkv, D]  --as_strided-->  [max_batch*max_ctx, Hkv, D]
        cu_seq_k[i] = slot_i * max_ctx   (requests sorted by slot, so it is monotone)
        seqused_k[i] = context_len_i     (the kernel reads keys [cu_seq_k[i], +seqused_k[i]))

    Without that argument (torch 2.10, 2.11) the same packed call goes straight to the kernel
    varlen_attn wraps, ``torch.ops.aten._flash_attention_forward``, whose schema has carried
    ``seqused_k`` since torch 2.5 (FA2 handles GQA natively there). Only when neither has it
    does it fall back to the per-request path. Either way it says once, as a warning, why.
paged
  * ``varlen_attn(..., block_table=, seqused_k=)`` when torch has it and the block size is a
    multiple of 256 (FA2's paged-KV constraint); else
  * batched decode: one gather of every request's used blocks (request after request) and
    the same one-call kernel as vmem decode, ``cu_seq_k`` at each request's first gathered
    block, ``seqused_k`` = its context length;
  * prefill / mixed batches: gather + SDPA-flash per request.

torch versions (see docs/attention.md): varlen_attn first shipped in 2.10 (causal via
``is_causal``, later ``window_size=(-1, 0)``); ``seqused_k``, ``block_table``, ``enable_gqa``
and ``num_splits`` landed on main in March 2026 (pytorch#175897, #175924) and are in the 2.12
docs, so torch 2.11 takes the aten operator for decode and gathers for paged. Detection is by
signature and operator schema, never by version number.
"""
from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import torch

from .base import AttentionBackend, Availability, PagedLayerView, VMemLayerView
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
                causal: bool, gqa: bool, **extra) -> torch.Tensor:
    """varlen_attn with whichever spelling of scale / causal / GQA the installed torch has."""
    kw = dict(extra)
    if "scale" in caps.params:
        kw["scale"] = scale
    else:  # no scale argument: the kernel uses 1/sqrt(D), so fold the ratio into q
        q = q * (scale * q.shape[-1] ** 0.5)
    if causal:  # FA2's causal mask is bottom-right aligned, as we need
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
    layouts = frozenset({"vmem", "paged"})
    dtypes = frozenset({torch.float16, torch.bfloat16})

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
        if view.lens.is_decode and len(view.lens.query_lens) > 1:
            kernel, why_not = self._batched_decode_kernel(q, view.kv_heads)
            why_not = why_not if kernel is None else self._packing_blocker(view)
            if not why_not:
                return self._packed_decode(q, view, scale, kernel)
            warn_once(f"flash: batched decode falls back to one SDPA-flash call per request: {why_not}")
        with _flash_ctx():
            return per_request(q, view, scale, causal_bias=True)

    def _batched_decode_kernel(self, q, kv_heads: int):
        """(kernel, "") for a one-call batched decode with per-sequence K lengths, or
        (None, why not). ``varlen_attn(seqused_k=)`` first; else the operator it wraps,
        ``aten._flash_attention_forward(seqused_k=)``, saying once that it goes there."""
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
        warn_once("flash: batched decode calls aten._flash_attention_forward(seqused_k=) "
                  f"directly, as varlen_attn cannot: {why_not_varlen}")
        return self._aten_kernel, ""

    @staticmethod
    def _packing_blocker(view: VMemLayerView) -> str:
        if _packed_view(view.k_cache) is None or _packed_view(view.v_cache) is None:
            return f"cache strides {view.k_cache.stride()} do not flatten to packed sequences"
        return ""

    def _packed_decode(self, q, view: VMemLayerView, scale, kernel):
        """One kernel call for the whole decode batch over the cache viewed as packed sequences.

        Requests are sorted by slot so ``cu_seq_k`` is monotone; q rows follow the sort and the
        outputs are put back in the caller's order. ``kernel(q, k, v, cu_q, cu_k, max_k, scale,
        seqused_k)`` returns ``[requests, heads, head_dim]``.
        """
        dev, mc = q.device, view.max_context
        order = sorted(range(len(view.host_slots)), key=view.host_slots.__getitem__)
        slots = [view.host_slots[i] for i in order]
        ctx = [view.lens.context_lens[i] for i in order]
        cu_k = torch.tensor([s * mc for s in slots] + [(slots[-1] + 1) * mc], dtype=torch.int32, device=dev)
        cu_q = torch.arange(len(order) + 1, dtype=torch.int32, device=dev)
        used = torch.tensor(ctx, dtype=torch.int32, device=dev)
        idx = torch.tensor(order, device=dev)
        out_sorted = kernel(q.index_select(0, idx), _packed_view(view.k_cache), _packed_view(view.v_cache),
                            cu_q, cu_k, max(ctx), scale, used)
        out = torch.empty_like(q)
        out[idx] = out_sorted
        return out

    @staticmethod
    def _varlen_kernel(q, k, v, cu_q, cu_k, max_k, scale, used):
        return call_varlen(varlen_caps(), q, k, v, cu_q, cu_k, 1, max_k, scale, causal=False,
                           gqa=q.shape[1] != k.shape[1], seqused_k=used)

    @staticmethod
    def _aten_kernel(q, k, v, cu_q, cu_k, max_k, scale, used):
        # positional: dropout_p 0, not causal (one query row per request), no debug mask
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale, seqused_k=used)[0]

    # ---- paged --------------------------------------------------------------------------
    def _forward_paged(self, q, view: PagedLayerView, scale):
        reason = self._block_table_blocker(q, view)
        if self.paged_mode == "block_table" and reason:
            raise UnsupportedError(f"flash paged_mode='block_table' is not possible: {reason}")
        if self.paged_mode != "gather" and not reason:
            return self._varlen_paged(q, view, scale)
        if view.lens.is_decode and len(view.lens.query_lens) > 1:
            kernel, why_not = self._batched_decode_kernel(q, view.kv_heads)
            if kernel is not None:
                if self.paged_mode == "auto":
                    warn_once(f"flash: paged decode gathers the batch's blocks in one copy and "
                              f"makes one kernel call: {reason}")
                return self._gathered_decode(q, view, scale, kernel)
            reason = f"{reason}; {why_not}"
        if self.paged_mode == "auto":
            warn_once(f"flash: paged attention gathers blocks per request: {reason}")
        with _flash_ctx():
            return per_request(q, view, scale, causal_bias=True)

    def _gathered_decode(self, q, view: PagedLayerView, scale, kernel):
        """Gather every request's used blocks with one index_select per pool (request after
        request), then one kernel call: request i's keys start at its first gathered block and
        ``seqused_k[i]`` = its context length (the tail of its last block is never read)."""
        dev, ctx = q.device, list(view.lens.context_lens)
        blocks = [view.num_blocks_of(i) for i in range(len(ctx))]
        used_columns = torch.arange(view.block_tables.shape[1], device=dev).unsqueeze(0) < \
            torch.tensor(blocks, device=dev).unsqueeze(1)
        ids = view.block_tables[used_columns].to(torch.long)          # row-major: in request order
        _, bs, hkv, d = view.k_pool.shape
        k = view.k_pool.index_select(0, ids).view(-1, hkv, d)
        v = view.v_pool.index_select(0, ids).view(-1, hkv, d)
        cu_k = torch.tensor([0] + _cumsum(b * bs for b in blocks), dtype=torch.int32, device=dev)
        cu_q = torch.arange(len(ctx) + 1, dtype=torch.int32, device=dev)
        used = torch.tensor(ctx, dtype=torch.int32, device=dev)
        return kernel(q, k, v, cu_q, cu_k, max(ctx), scale, used)

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
        dev, lens = q.device, view.lens
        cu_q = torch.tensor(list(lens.q_starts) + [lens.total_query_tokens], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + _cumsum(lens.context_lens), dtype=torch.int32, device=dev)
        used = torch.tensor(lens.context_lens, dtype=torch.int32, device=dev)
        return call_varlen(varlen_caps(), q, view.k_pool, view.v_pool, cu_q, cu_k,
                           max(lens.query_lens), max(lens.context_lens), scale, causal=True,
                           gqa=q.shape[1] != view.kv_heads, seqused_k=used,
                           block_table=view.block_tables.to(torch.int32))


def _cumsum(xs) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out
