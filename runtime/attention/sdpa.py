"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, one call per request.

vmem: each request's ``k_cache[slot, :ctx]`` is passed as a strided view, in place (no copy;
the cache is never materialised). paged: the request's blocks are gathered, then the same call.

Why per request, even for batched decode: requests in different slots cannot be stacked into
one ``[batch, ...]`` tensor without copying them (advanced indexing copies), and a padded batch
over ``k_cache[:, :max_ctx]`` would read other slots and unmapped memory. Measured on the CPU
(batch 8, ctx 2k, fp32, 32/8 heads): the per-request loop with the GQA fold (see
``kv.attend_one``) is ~12 ms, while one batched copy of the slices alone costs ~48 ms.
"""
from __future__ import annotations

from .base import AttentionBackend

from .views import ALL_KV_DTYPES
from .kv import per_request


class SdpaBackend(AttentionBackend):
    """PyTorch SDPA on CPU and CUDA; torch picks the kernel (flash / mem-efficient / math)."""
    name = "sdpa"
    devices = frozenset({"cpu", "cuda"})
    kinds = frozenset({"vmem", "paged"})
    supports_kv_starts = True
    layer_features = frozenset({"window", "softcap"})   # a window mask; soft-capped math
    kv_dtypes = ALL_KV_DTYPES   # other dtypes cast to q's; 8-bit dequantized per request (kv.py)

    def _forward_vmem(self, q, view, scale):
        return per_request(q, view, scale, causal_bias=q.is_cuda)

    def _forward_paged(self, q, view, scale):
        return per_request(q, view, scale, causal_bias=q.is_cuda)
