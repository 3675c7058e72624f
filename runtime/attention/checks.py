"""Input checks every backend's ``forward`` runs before reading anything: cache pair shapes and
strides, the query against the cache and the per-request metadata (lens, kv_starts). Each raises
:class:`AttentionShapeError` naming the shapes or values."""
from __future__ import annotations

import math
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from .errors import AttentionShapeError

if TYPE_CHECKING:
    from .views import BatchLens


def check_cache_pair(k: torch.Tensor, v: torch.Tensor, kn: str, vn: str) -> None:
    if k.dim() != 4 or k.shape != v.shape:
        raise AttentionShapeError(f"{kn} {tuple(k.shape)} and {vn} {tuple(v.shape)} must be "
                                  f"equal 4-d shapes")
    if k.dtype != v.dtype:   # a kernel reads both with one element type
        raise AttentionShapeError(f"{kn} ({k.dtype}) and {vn} ({v.dtype}) must share a dtype")
    if 0 in k.shape[2:]:
        raise AttentionShapeError(f"{kn} {tuple(k.shape)} needs kv_heads and head_dim >= 1")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise AttentionShapeError(f"{kn}/{vn} need a contiguous last dim; strides "
                                  f"{k.stride()} / {v.stride()}")


def check_int_tensor(t: torch.Tensor, name: str) -> None:
    """AttentionShapeError unless ``t`` holds integers (a float slot 1.9 was read as slot 1)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise AttentionShapeError(f"{name} must be an integer tensor, got {t.dtype}")


def packed_starts(query_lens) -> tuple:
    """Each request's first row in packed q: the exclusive running sum of ``query_lens``."""
    return (0, *accumulate(query_lens))[:len(query_lens)]


def host_ints(t: torch.Tensor, name: str) -> list:
    """A 1-d integer tensor's values as a Python list (``check_int_tensor`` first)."""
    check_int_tensor(t, name)
    if t.dim() != 1:
        raise AttentionShapeError(f"{name} must be 1-d, one entry per request; got shape "
                                  f"{tuple(t.shape)}")
    return t.tolist()


# fp32's normal range, where the kernels compute both: past it a scale or cap of 1e39 made every
# output NaN, and a cap of 1e-46 was 0 (no cap) in cpu-varlen but a cap in reference and sdpa
FP32_TINY, FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def check_scalars(scale: float, softcap) -> None:
    """The attention scale and logit soft-cap: finite, scale non-zero, soft-cap > 0 (an infinite
    one made every output NaN), each of a magnitude fp32 holds (``FP32_TINY`` to ``FP32_MAX``)."""
    if not math.isfinite(scale) or scale == 0:
        raise AttentionShapeError(f"scale must be finite and non-zero, got {scale!r}")
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        raise AttentionShapeError(f"a layer's logit softcap must be finite and > 0 or None, "
                                  f"got {softcap!r}")
    for name, value in (("scale", abs(scale)), ("a layer's logit softcap", softcap)):
        if value is not None and not FP32_TINY <= value <= FP32_MAX:
            raise AttentionShapeError(f"{name} must have a magnitude fp32 holds, in "
                                      f"[{FP32_TINY:.4g}, {FP32_MAX:.4g}], got {value!r}")


# the most tokens a request's context may hold: the kernels keep key positions in 32-bit ints
# (cpu_varlen.c's per-row key ranges, FA2's sequence lengths); a sliding window at least this
# wide is no window (base.AttentionBackend.forward)
MAX_CONTEXT_TOKENS = 2**31 - 1


def check_query(q: torch.Tensor, k: torch.Tensor, lens: BatchLens, batch_shape, what: str) -> None:
    if q.dim() != 3:
        raise AttentionShapeError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    kv_heads, head_dim = k.shape[2], k.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % kv_heads or not q.shape[1]:
        raise AttentionShapeError(
            f"q {tuple(q.shape)} does not fit cache {tuple(k.shape)}: head_dim must match and "
            f"num_heads must be a positive multiple of kv_heads={kv_heads}")
    n = len(lens.context_lens)
    if len(lens.query_lens) != n or tuple(batch_shape) != (n,):
        raise AttentionShapeError(f"context_lens ({n}), query_lens ({len(lens.query_lens)}) and "
                                  f"{what} {tuple(batch_shape)} must have one entry per request")
    packed = packed_starts(lens.query_lens)
    if tuple(lens.q_starts) != packed:   # rows overlapped or were left unwritten (torch.empty)
        raise AttentionShapeError(f"q_starts {list(lens.q_starts)} must be the packed rows of "
                                  f"query_lens {list(lens.query_lens)}: {list(packed)}")
    if lens.total_query_tokens != q.shape[0]:
        raise AttentionShapeError(f"q {tuple(q.shape)} has {q.shape[0]} tokens but query_lens "
                                  f"{list(lens.query_lens)} sum to {lens.total_query_tokens}")
    if any(not 0 < ql <= c for ql, c in zip(lens.query_lens, lens.context_lens)):
        raise AttentionShapeError(f"need 0 < query_len <= context_len per request; got query_lens "
                                  f"{list(lens.query_lens)}, context_lens {list(lens.context_lens)}")
    if max(lens.context_lens, default=0) > MAX_CONTEXT_TOKENS:
        raise AttentionShapeError(f"context_lens {list(lens.context_lens)} exceed the "
                                  f"{MAX_CONTEXT_TOKENS} tokens a request may hold")
    check_kv_starts(lens)
    if q.device != k.device:   # the dtypes: AttentionBackend.kv_dtypes (checked before)
        raise AttentionShapeError(f"q ({q.dtype}, {q.device}) and cache ({k.dtype}, {k.device}) "
                                  f"must share a device")


def check_kv_starts(lens: BatchLens) -> None:
    """Every query row must see at least its own key: 0 <= kv_start <= context_len - query_len."""
    if not lens.kv_starts:
        return
    n = len(lens.context_lens)
    if len(lens.kv_starts) != n:
        raise AttentionShapeError(f"kv_starts {list(lens.kv_starts)} must have one entry per "
                                  f"request ({n})")
    bad = [i for i, (s, c, ql) in enumerate(zip(lens.kv_starts, lens.context_lens, lens.query_lens))
           if not 0 <= s <= c - ql]
    if bad:
        i = bad[0]
        raise AttentionShapeError(
            f"kv_starts[{i}] = {lens.kv_starts[i]} must be in [0, context_len - query_len = "
            f"{lens.context_lens[i] - lens.query_lens[i]}] so every query sees its own key")
