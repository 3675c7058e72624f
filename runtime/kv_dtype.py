"""KV cache encodings (``kv_cache_dtype``): what a cache stores per element, and the codec.

    name       stored as              bytes  scaled  quantize (x: the model's K or V)
    auto       the model's dtype      2 / 4  no      x
    bf16       torch.bfloat16         2      no      x.to(bf16)
    fp16       torch.float16          2      no      x.to(fp16)
    fp8_e4m3   torch.float8_e4m3fn    1      yes     clamp(x / s, -448, 448).to(e4m3fn)   (RNE)
    fp8_e5m2   torch.float8_e5m2      1      yes     clamp(x / s, -57344, 57344).to(e5m2) (RNE)
    int8       torch.int8             1      yes     clamp(round(x / s), -127, 127)      (RNE)

    dequantize: stored.float() * s  (fp32), s the scale of the element's (layer, KV head)

Scales (``KVScales``): fp32, one per (layer, KV head) for K and one for V, stored beside the
cache. Given by the user, or computed at the first write of each layer (``first_write_scales``:
per KV head, amax of |x| over that write's tokens and head_dim, divided by the encoding's max,
as vLLM's ``calculate_kv_scales`` does per tensor) and fixed from then on, so every token of a
layer, forks and prefix hits included, shares one encoding. Lives beside ``config.py`` (not in
``cache/``) because ``CacheConfig`` validates with it and ``cache/`` imports the config.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES, KV_CACHE_DTYPES

from .errors import CacheConfigError


@dataclass(frozen=True)
class KVEncoding:
    """One ``kv_cache_dtype``: its storage dtype and, for 8-bit ones, the largest stored value."""
    name: str
    storage: torch.dtype
    max_value: Optional[float] = None    # None: unscaled (16/32-bit); else the saturation bound

    @property
    def scaled(self) -> bool:
        """Whether this encoding stores x / scale (8-bit) rather than x."""
        return self.max_value is not None

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.storage).element_size()

    def quantize(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [..., kv_heads, head_dim] in the storage dtype; ``scale`` [kv_heads] fp32 for a
        scaled encoding (saturating at +-max_value; NaN stays NaN for fp8)."""
        if not self.scaled:
            return x.to(self.storage)
        y = x.float() / scale.unsqueeze(-1)
        if self.storage == torch.int8:
            y = y.round()
        return y.clamp_(-self.max_value, self.max_value).to(self.storage)

    def dequantize(self, stored: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values ``stored`` [..., kv_heads, head_dim] holds: fp32 ``stored * scale`` for a
        scaled encoding, ``stored`` itself otherwise."""
        if not self.scaled:
            return stored
        return stored.float() * scale.unsqueeze(-1)


_FIXED = {
    "bf16": KVEncoding("bf16", torch.bfloat16),
    "fp16": KVEncoding("fp16", torch.float16),
    "fp8_e4m3": KVEncoding("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVEncoding("fp8_e5m2", torch.float8_e5m2, 57344.0),
    "int8": KVEncoding("int8", torch.int8, 127.0),
}
assert KV_CACHE_DTYPES == ("auto",) + tuple(_FIXED) and all(
    KV_CACHE_DTYPE_BYTES[n] == e.element_bytes for n, e in _FIXED.items())   # one table of names
SCALED_STORAGE = frozenset(e.storage for e in _FIXED.values() if e.scaled)


def kv_encoding(name: str, model_dtype: torch.dtype) -> KVEncoding:
    """The encoding ``name`` (``auto``: the model's dtype, unscaled); CacheConfigError naming
    ``kv_cache_dtype`` for anything else."""
    if name == "auto":
        return KVEncoding("auto", model_dtype)
    try:
        return _FIXED[name]
    except (KeyError, TypeError):
        raise CacheConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                               f"got {name!r}") from None


@dataclass(frozen=True)
class KVScales:
    """User-given scales: ``k`` and ``v`` each ``num_layers`` rows of ``num_kv_heads`` floats."""
    k: tuple
    v: tuple

    @classmethod
    def of(cls, k, v) -> "KVScales":
        """From nested sequences or tensors [layers, kv_heads] (values checked by ``check``)."""
        def rows(x, name):
            if isinstance(x, torch.Tensor):
                x = x.tolist()
            try:
                return tuple(tuple(float(s) for s in row) for row in x)
            except (TypeError, ValueError):
                raise CacheConfigError(f"kv_scales.{name} must be [num_layers][num_kv_heads] "
                                       f"numbers, got {x!r}"[:200]) from None
        return cls(rows(k, "k"), rows(v, "v"))

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        """CacheConfigError naming the field unless both are [num_layers][num_kv_heads] finite
        positive numbers."""
        for name in ("k", "v"):
            rows = getattr(self, name)
            shape = (len(rows), tuple(len(r) for r in rows))
            if len(rows) != num_layers or any(len(r) != num_kv_heads for r in rows):
                raise CacheConfigError(f"kv_scales.{name} must have shape [{num_layers}, "
                                       f"{num_kv_heads}] (num_layers, num_kv_heads), got "
                                       f"{shape[0]} rows of lengths {sorted(set(shape[1]))}")
            bad = [(i, j, s) for i, r in enumerate(rows) for j, s in enumerate(r)
                   if not (math.isfinite(s) and s > 0)]
            if bad:
                i, j, s = bad[0]
                raise CacheConfigError(f"kv_scales.{name}[{i}][{j}] must be a finite number > 0, "
                                       f"got {s!r}")

    @property
    def digest(self) -> str:
        """A short hash of the values (part of the prefix cache's key)."""
        data = repr((self.k, self.v)).encode()
        return hashlib.sha256(data).hexdigest()[:16]


def first_write_scales(x: torch.Tensor, encoding: KVEncoding) -> torch.Tensor:
    """Per KV head of ``x`` [..., tokens, kv_heads, head_dim]: amax(|x|) / max_value (fp32
    [kv_heads]); a head whose amax is 0 or not finite gets 1.0 (a scale must be finite > 0)."""
    amax = x.detach().reshape(-1, *x.shape[-2:]).abs().float().amax(dim=(0, 2))
    scale = amax / encoding.max_value
    return torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))


class ScaleTable:
    """The scales of one cache: fp32 ``k``, ``v`` [num_layers, kv_heads] on its device, and which
    layers' are fixed (given up front, or at their first write). Views hand attention rows of
    these tensors, which are filled in place, so a view built before the first write reads the
    fixed values."""

    def __init__(self, encoding: KVEncoding, num_layers: int, num_kv_heads: int,
                 device: torch.device, given: Optional[KVScales] = None) -> None:
        self.encoding = encoding
        shape = (num_layers, num_kv_heads)
        if given is None:
            self.k = torch.ones(shape, dtype=torch.float32, device=device)
            self.v = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            self.k = torch.tensor(given.k, dtype=torch.float32, device=device)
            self.v = torch.tensor(given.v, dtype=torch.float32, device=device)
        self.fixed = [given is not None] * num_layers

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """``k``, ``v`` [..., kv_heads, head_dim] quantized with ``layer``'s scales, fixing
        them from this write when it is the layer's first. A step rolled back after its writes
        keeps them: they name the cache's encoding, which every later write shares."""
        if not self.fixed[layer]:
            self.k[layer] = first_write_scales(k, self.encoding)
            self.v[layer] = first_write_scales(v, self.encoding)
            self.fixed[layer] = True
        return (self.encoding.quantize(k, self.k[layer]),
                self.encoding.quantize(v, self.v[layer]))
