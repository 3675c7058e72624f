"""``flash-attn``: the flash-attn package's ``flash_attn_with_kvcache`` (CUDA, fp16/bf16).

The keys/values are already in the cache, so ``k``/``v`` are not passed and
``cache_seqlens = context_len`` (this step's tokens included); FA2 then attends over
``cache[:cache_seqlens]`` with a bottom-right causal mask, which is exactly our semantics.

* vmem: ``k_cache`` is the (possibly strided) ``[max_batch, max_ctx, Hkv, D]`` view and
  ``cache_batch_idx = slot``; flash-attn only makes the last dim contiguous, so no copy.
* paged: the pool with ``block_table``; FA2 needs block_size % 256 == 0 (typed error otherwise).

``flash_attn_with_kvcache`` takes q as ``[batch, seqlen_q, H, D]``, one seqlen_q for all, so
requests are grouped by query length: all decodes go in one call, prefills by equal length.
"""
from __future__ import annotations

import importlib.util
from collections import defaultdict

import torch

from .base import AttentionBackend, Availability

from .views import PagedLayerView, VMemLayerView
from .errors import UnsupportedError
from .flash import FA2_PAGED_BLOCK_MULTIPLE


class FlashAttnBackend(AttentionBackend):
    """flash-attn's kvcache kernel; imported lazily, unavailable (with the reason) if absent."""
    name = "flash-attn"
    devices = frozenset({"cuda"})
    kinds = frozenset({"vmem", "paged"})
    dtypes = frozenset({torch.float16, torch.bfloat16})

    @classmethod
    def available(cls) -> Availability:
        if importlib.util.find_spec("flash_attn") is None:
            return Availability(False, "the flash-attn package is not installed (pip install flash-attn)")
        if not torch.cuda.is_available():
            return Availability(False, "CUDA is not available (flash-attn runs on NVIDIA GPUs only)")
        try:
            from flash_attn import flash_attn_with_kvcache  # noqa: F401
        except Exception as e:  # a broken build (ABI mismatch with torch) raises ImportError/OSError
            return Availability(False, f"flash_attn failed to import: {e}")
        return Availability(True)

    def _forward_vmem(self, q, view: VMemLayerView, scale):
        slots = view.memo(("flash-attn.slots", q.device),
                          lambda: view.slots.to(device=q.device, dtype=torch.int32))
        return self._grouped(q, view, scale, view.k_cache, view.v_cache,
                             lambda idx: {"cache_batch_idx": slots[idx]})

    def _forward_paged(self, q, view: PagedLayerView, scale):
        if view.block_size % FA2_PAGED_BLOCK_MULTIPLE:
            raise UnsupportedError(
                f"flash-attn paged KV needs block_size to be a multiple of "
                f"{FA2_PAGED_BLOCK_MULTIPLE}, got {view.block_size}; use 'flash' or 'sdpa'")
        table = view.memo(("flash-attn.table", q.device),
                          lambda: view.block_tables.to(device=q.device, dtype=torch.int32))
        return self._grouped(q, view, scale, view.k_pool, view.v_pool,
                             lambda idx: {"block_table": table[idx]})

    def _grouped(self, q, view, scale, k_cache, v_cache, cache_args):
        from flash_attn import flash_attn_with_kvcache
        out = torch.empty_like(q)
        ctx, groups = view.memo(("flash-attn.groups", q.device), lambda: _groups(view, q.device))
        for n, rows, idx in groups:
            qg = q.index_select(0, rows).view(len(idx), n, *q.shape[1:])   # (Bg, n, H, D)
            og = flash_attn_with_kvcache(qg, k_cache, v_cache, cache_seqlens=ctx[idx],
                                         softmax_scale=scale, causal=True, **cache_args(idx))
            out[rows] = og.reshape(-1, *q.shape[1:])
        return out


def _groups(view, dev) -> tuple:
    """Per step, once: (context lens, [(query_len, q rows, request indices)]) on ``dev``."""
    lens = view.lens
    members: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lens.query_lens):
        members[n].append(i)
    ctx = torch.tensor(lens.context_lens, dtype=torch.int32, device=dev)
    groups = [(n, torch.tensor([lens.q_starts[i] + t for i in idx for t in range(n)], device=dev),
               torch.tensor(idx, device=dev)) for n, idx in members.items()]
    return ctx, groups
