"""Per-request K/V access and the one-request SDPA call shared by the sdpa and flash backends.

Everything here touches only a request's live tokens: ``cache[slot, kv_start:ctx]`` is a view
whose extent is the layer's readable keys (no copy, no read outside it), and a paged gather reads
only the block-table entries ``kv_start // block_size .. ceil(ctx / block_size) - 1``.
``kv_start`` is 0 on full-attention layers; on a sliding-window layer it is the first key the
step's earliest query sees (``base.window_starts``), and the window mask hides the rest.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from vmemkv.scheduler.layout import CacheKind

from .views import PagedLayerView, VMemLayerView

# enable_gqa= arrived in scaled_dot_product_attention in torch 2.5.
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


def vmem_kv(view: VMemLayerView, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's readable keys and values as zero-copy views ``[ctx - kv_start, kv_heads,
    head_dim]`` (an 8-bit cache: fp32 copies, dequantized)."""
    slot, ctx, start = view.host_slots[i], view.lens.context_lens[i], view.kv_starts[i]
    return view.decode(view.k_cache[slot, start:ctx], view.v_cache[slot, start:ctx])


def paged_kv(view: PagedLayerView, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's readable keys and values gathered from its blocks: ``[ctx - kv_start,
    kv_heads, head_dim]`` copies.

    Only the block-table entries ``first = kv_start // block_size`` to ``ceil(ctx / block_size)``
    are read; the head of the first block (before kv_start) and the tail of the last (past ctx)
    are copied but sliced off before anyone looks at them.
    """
    ctx, nb, first = view.lens.context_lens[i], view.num_blocks_of(i), view.first_block_of(i)
    ids = view.block_tables[i, first:nb].to(torch.long)
    _, bs, hkv, d = view.k_pool.shape
    lo, hi = view.kv_starts[i] - first * bs, ctx - first * bs
    k = view.k_pool.index_select(0, ids).view(-1, hkv, d)[lo:hi]   # (ctx - kv_start, Hkv, D)
    v = view.v_pool.index_select(0, ids).view(-1, hkv, d)[lo:hi]
    return view.decode(k, v)


def request_rows(view) -> Iterator[tuple[int, int, int]]:
    """(request index, first q row, query_len) per request."""
    lens = view.lens
    for i, (start, n) in enumerate(zip(lens.q_starts, lens.query_lens)):
        yield i, start, n


def lower_right_mask(t: int, s: int, device, window: Optional[int] = None) -> torch.Tensor:
    """Bool ``[t, s]``: query row r (position s - t + r among the s keys) may see key j iff
    j <= s - t + r, and, under a sliding ``window``, j > s - t + r - window."""
    rows = torch.arange(t, device=device).unsqueeze(1) + (s - t)
    keys = torch.arange(s, device=device).unsqueeze(0)
    visible = keys <= rows
    return visible if window is None else visible & (keys > rows - window)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal_bias: bool = False, window: Optional[int] = None,
               softcap: Optional[float] = None) -> torch.Tensor:
    """Attention of one request. q ``[T, H, D]``; k, v ``[S, Hkv, D]`` (views); -> ``[T, H, D]``.

    The S keys are the request's readable keys: the last key is the last query's position, so
    the masks are bottom-right aligned whatever key the slice starts at.
    Decode (T == 1) folds the G = H / Hkv query heads of each KV head into G query rows
    ``(1, Hkv, G, D)``: no mask is needed (one position sees every key; a windowed slice holds
    only keys in its window), no GQA expansion, and each KV head is read once instead of G times
    (2x faster than enable_gqa on CPU). Prefill uses a bottom-right causal mask: a bool mask
    (CPU, or a sliding window that hides some keys), or ``causal_lower_right``
    (``causal_bias=True``, CUDA) which keeps the flash / mem-efficient kernels eligible.
    A logit ``softcap`` has no SDPA kernel: those layers take :func:`softcapped_attention`.
    K/V in another dtype than q (``kv_cache_dtype``) run in fp32, q's dtype out: a cast to
    q's dtype rounded them (fp16 K under bf16 q: outputs 16 bf16 ulps off at scores of ~900).
    """
    t, h, d = q.shape
    s, hkv, _ = k.shape
    if k.dtype != q.dtype:            # K/V stored in another dtype (kv_cache_dtype): exact
        return attend_one(q.float(), k.float(), v.float(), scale, causal_bias, window,
                          softcap).to(q.dtype)
    if window is not None and s <= window:
        window = None                 # every query's window covers all of its keys
    if softcap is not None:
        return softcapped_attention(q, k, v, scale, softcap, lower_right_mask(t, s, q.device, window))
    kt = k.transpose(0, 1).unsqueeze(0)   # (1, Hkv, S, D), strided view
    vt = v.transpose(0, 1).unsqueeze(0)
    if t == 1:
        qf = q.reshape(1, hkv, h // hkv, d)                          # (1, Hkv, G, D)
        return F.scaled_dot_product_attention(qf, kt, vt, scale=scale).reshape(1, h, d)
    qt = q.transpose(0, 1).unsqueeze(0)                               # (1, H, T, D)
    if h != hkv and not SDPA_HAS_GQA:   # torch < 2.5: expand this request's slice only
        kt = kt.repeat_interleave(h // hkv, dim=1)
        vt = vt.repeat_interleave(h // hkv, dim=1)
    gqa = {"enable_gqa": True} if h != hkv and SDPA_HAS_GQA else {}
    if t == s and window is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, **gqa)
    else:
        mask = _causal_bias(t, s) if causal_bias and window is None else \
            lower_right_mask(t, s, q.device, window)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, **gqa)
    return out.squeeze(0).transpose(0, 1)                             # (T, H, D)


def _causal_bias(t: int, s: int):
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(t, s)


def softcapped_attention(q, k, v, scale: float, softcap: float, visible: torch.Tensor) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) masked by ``visible`` [T, S]) v: scores, cap and
    softmax in fp32 (in fp16, ``scores / cap`` underflowed to 0 for a cap of 1e30: uniform
    weights), ``p @ v`` in the input dtype. q [T,H,D]; k, v [S,Hkv,D]."""
    t, h, _ = q.shape
    hkv = k.shape[1]
    kx = k.repeat_interleave(h // hkv, dim=1)                          # (S, H, D)
    vx = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kx.float()) * scale   # (H, T, S) fp32
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = scores.softmax(-1).to(q.dtype)
    return torch.einsum("hts,shd->thd", weights, vx)


def per_request(q: torch.Tensor, view, scale: float, causal_bias: bool = False) -> torch.Tensor:
    """Loop over requests: slice (vmem, zero copy) or gather (paged) the layer's readable keys,
    then :func:`attend_one` with the layer's window and soft-cap."""
    kv_of = vmem_kv if view.kind is CacheKind.VMEM else paged_kv
    out = torch.empty_like(q)
    for i, start, n in request_rows(view):
        k, v = kv_of(view, i)
        out[start:start + n] = attend_one(q[start:start + n], k, v, scale, causal_bias,
                                          view.window, view.softcap)
    return out
