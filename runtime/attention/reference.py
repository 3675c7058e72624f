"""``reference``: plain dense attention in fp32 over explicitly gathered K/V. For tests only.

It shares no code with the fast backends' K/V access: vmem rows are sliced directly and paged
tokens are gathered one position at a time through the block table, so a bug in ``kv.py``
cannot hide by appearing on both sides of a comparison.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import AttentionBackend

from .views import ALL_KV_DTYPES, PagedLayerView, VMemLayerView


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """fp32 softmax(softcap(q k^T * scale) + bottom-right causal [+ window]) v.
    q [T,H,D]; k, v [S,Hkv,D] (the last key is the last query's position) -> [T,H,D]."""
    t, h, _ = q.shape
    s, hkv, _ = k.shape
    k = k.float().repeat_interleave(h // hkv, dim=1)                   # (S, H, D)
    v = v.float().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale        # (H, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(t, device=q.device).unsqueeze(1) + (s - t)      # query position among keys
    key = torch.arange(s, device=q.device).unsqueeze(0)
    visible = key <= pos                                               # (T, S)
    if window is not None:
        visible &= key > pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).to(q.dtype)


class ReferenceBackend(AttentionBackend):
    """Dense fp32 math; slow and simple on purpose. Every other backend is checked against it.
    Reads each request's keys from ``kv_start`` (the window's first key) to ``context_len``."""
    name = "reference"
    devices = frozenset({"cpu", "cuda"})
    kinds = frozenset({"vmem", "paged"})
    supports_kv_starts = True   # keys kv_start .. ctx - 1 only: the earlier ones are never read
    layer_features = frozenset({"window", "softcap"})
    kv_dtypes = ALL_KV_DTYPES    # 8-bit K/V dequantized to fp32 (view.decode), as all are

    def _forward_vmem(self, q, view: VMemLayerView, scale):
        out = torch.empty_like(q)
        for i, slot in enumerate(view.host_slots):
            ctx, n, start = view.lens.context_lens[i], view.lens.query_lens[i], view.lens.q_starts[i]
            lo = view.kv_starts[i]
            k, v = view.decode(view.k_cache[slot, lo:ctx], view.v_cache[slot, lo:ctx])
            out[start:start + n] = dense_attention(q[start:start + n], k, v, scale,
                                                   view.window, view.softcap)
        return out

    def _forward_paged(self, q, view: PagedLayerView, scale):
        out = torch.empty_like(q)
        bs = view.block_size
        for i in range(len(view.lens.context_lens)):
            ctx, n, start = view.lens.context_lens[i], view.lens.query_lens[i], view.lens.q_starts[i]
            pos = torch.arange(view.kv_starts[i], ctx, device=q.device)
            blocks = view.block_tables[i].to(torch.long)[pos // bs]     # one entry per token
            k, v = view.decode(view.k_pool[blocks, pos % bs], view.v_pool[blocks, pos % bs])
            out[start:start + n] = dense_attention(q[start:start + n], k, v, scale,
                                                   view.window, view.softcap)
        return out
