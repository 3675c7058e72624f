"""KV cache encodings (``kv_cache_dtype``): what a cache stores per element, and the codec.

    name       stored as              bytes  scaled  quantize (x: the model's K or V)
    auto       the model's dtype      2 / 4  no      x
    bf16       torch.bfloat16         2      no      x.to(bf16)
    fp16       torch.float16          2      no      x.to(fp16)
    fp8_e4m3   torch.float8_e4m3fn    1      yes     clamp(x / s, -448, 448).to(e4m3fn)   (RNE)
    fp8_e5m2   torch.float8_e5m2      1      yes     clamp(x / s, -57344, 57344).to(e5m2) (RNE)
    int8       torch.int8             1      yes     clamp(round(x / s), -127, 127)      (RNE)

    dequantize: stored.float() * s  (fp32), s the scale of the element's (layer, KV head)

Scales (``KVScales``, ``ScaleTable``): fp32, one per (layer, KV head) for K and one for V,
beside the cache: given (the user's, the checkpoint's ``checkpoint_kv_scales``, or calibrated:
kv_calibration.py; the engine's order: ``kv_scales_for``, engine/config.py), or fixed at each
layer's first write (``first_write_scales``: per KV head, amax |x| over the write / the
encoding's max, as vLLM's ``calculate_kv_scales`` per tensor; later, larger K/V saturate), so
every token of a layer, forks and prefix hits included, shares one encoding. K or V holding NaN
or +-inf is refused (NonFiniteKVError) before anything is fixed or stored.
Not in ``cache/``: ``CacheConfig``, which ``cache/`` imports, validates with it.
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Optional

import torch

from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES, KV_CACHE_DTYPES

from .errors import CacheConfigError, NonFiniteKVError


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
        scaled encoding (saturating at +-max_value; NaN and +-inf are refused before:
        ScaleTable.encode)."""
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
    """Given scales (the user's or a checkpoint's): ``k`` and ``v`` each ``num_layers`` rows of
    ``num_kv_heads`` floats rounded to the fp32 the cache holds, however built (``KVScales(k, v)``
    kept str, True, 1e-50: 0 in fp32), so equal encodings have one digest."""
    k: tuple
    v: tuple

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            x = getattr(self, name)
            x = x.tolist() if isinstance(x, torch.Tensor) else x
            try:
                object.__setattr__(self, name, tuple(tuple(_fp32(s) for s in row) for row in x))
            except (TypeError, ValueError):
                raise CacheConfigError(f"kv_scales.{name} must be [num_layers][num_kv_heads] "
                                       f"numbers, got {x!r}"[:200]) from None

    @classmethod
    def of(cls, k, v) -> "KVScales":
        return cls(k, v)   # nested sequences or tensors [layers, kv_heads], checked by ``check``

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
                   if not _usable(s)]
            if bad:
                i, j, s = bad[0]
                raise CacheConfigError(f"kv_scales.{name}[{i}][{j}] must be a finite number > 0, "
                                       f"got {s!r}")

    @property
    def digest(self) -> str:
        """A short hash of the values (part of the prefix cache's key)."""
        data = repr((self.k, self.v)).encode()
        return hashlib.sha256(data).hexdigest()[:16]


def _usable(scale: float) -> bool:
    """A scale must be finite and > 0 (x / scale must be a number)."""
    return math.isfinite(scale) and scale > 0


def _fp32(s) -> float:
    """The number ``s`` as a float rounded to fp32 (RNE); +-inf past fp32's range (an int or
    Fraction past a float's too), refused by ``check``. TypeError for a str, bytes or bool."""
    if isinstance(s, (str, bytes, bool)):
        raise TypeError(f"{s!r} is not a number")
    try:
        value = float(s)
    except OverflowError:
        return math.inf if s > 0 else -math.inf
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def first_write_scales(x: torch.Tensor, encoding: KVEncoding) -> torch.Tensor:
    """Per KV head of ``x`` [..., tokens, kv_heads, head_dim]: amax(|x|) / max_value (fp32
    [kv_heads]); a head whose amax is 0 gets 1.0 (a given scale must be finite > 0; a
    ScaleTable's first write leaves it open instead). NonFiniteKVError for NaN or +-inf."""
    return scales_of_amax(_head_amax(x), encoding)


def _head_amax(x: torch.Tensor) -> torch.Tensor:   # fp32 [kv_heads]
    return x.detach().reshape(-1, *x.shape[-2:]).abs().float().amax(dim=(0, 2))


def scales_of_amax(amax: torch.Tensor, encoding: KVEncoding) -> torch.Tensor:
    """``first_write_scales`` from per-KV-head amax(|x|) (fp32 [kv_heads]): amax / max_value,
    1.0 where it is 0; NonFiniteKVError where it is not finite."""
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteKVError(f"K or V holds NaN or +-inf (per KV head amax {amax.tolist()}), "
                               f"which no {encoding.name} scale encodes")
    return _nonzero(amax.float() / encoding.max_value)


class ScaleTable:
    """The scales of one cache: fp32 ``k``, ``v`` [num_layers, kv_heads] on its device, and which
    layers' are fixed (given up front, or at their first write). Views hand attention rows of
    these tensors, filled in place, so a view built before the first write reads the fixed
    values. ``unsettled``: the layers first writes fixed since ``settle``, which
    ``unfix_unsettled`` unfixes (a step rolled back: a failed request fixes nobody's scales).
    A head a first write leaves all 0 gets scale 0, "open" (its 1.0 rounded later int8 K/V
    below 0.5 to 0): it has stored only 0s, which decode to 0 under any scale, so the first
    write that reaches it fixes it (journaled in ``unsettled_heads`` until ``settle``)."""

    def __init__(self, encoding: KVEncoding, num_layers: int, num_kv_heads: int,
                 device: torch.device, given: Optional[KVScales] = None) -> None:
        self.encoding = encoding
        ones = [[1.0] * num_kv_heads] * num_layers     # unfixed
        k, v = (ones, ones) if given is None else (given.k, given.v)
        self.k = torch.tensor(k, dtype=torch.float32, device=device)
        self.v = torch.tensor(v, dtype=torch.float32, device=device)
        self.given = given is not None
        self.fixed = [self.given] * num_layers
        self.unsettled: list = []   # layer indices, in the order their first writes fixed them
        self.unsettled_heads: list = []   # (layer, K heads, V heads) open ones later writes fixed
        # the layers that may hold an open head (each with one is in it; checked at its next write)
        self.maybe_open = set() if self.given else set(range(num_layers))
        # a tensor-parallel rank's cache (worker.build_rank): encode records non-finite K/V in
        # ``non_finite`` and stores zeros; the ranks agree after the forward (RankExecutor.forward)
        self.defer_non_finite = False
        self.non_finite: Optional[str] = None   # the first such write's message, until taken

    def unfix(self, layer: Optional[int] = None) -> None:
        """Unfix the scales first writes fixed (of every layer, or ``layer``); given ones stay.
        For first writes that were a check's (tensor_parallel.py) or did not land (hf/cache.py)."""
        if self.given:
            return
        layers = range(len(self.fixed)) if layer is None else (layer,)
        for index in layers:
            self.k[index] = self.v[index] = 1.0
            self.fixed[index] = False
            self.unsettled = [i for i in self.unsettled if i != index]
            self.unsettled_heads = [e for e in self.unsettled_heads if e[0] != index]

    def settle(self) -> None:
        """The writes that fixed scales since the last ``settle`` are kept (a step committed)."""
        self.unsettled.clear()
        self.unsettled_heads.clear()

    def unfix_unsettled(self) -> list:
        """Unfix the layers first writes fixed since ``settle``, reopen the heads later writes
        fixed (not kept: a step rolled back, a request's lone run); returns those layers."""
        layers = list(self.unsettled)
        for layer in layers:
            self.unfix(layer)
        for layer, k_heads, v_heads in self.unsettled_heads:
            self.k[layer][k_heads], self.v[layer][v_heads] = 0.0, 0.0   # open again
            self.maybe_open.add(layer)
        layers += [layer for layer, _, _ in self.unsettled_heads if layer not in layers]
        self.unsettled_heads.clear()
        return layers

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """``k``, ``v`` [..., kv_heads, head_dim] quantized with ``layer``'s scales, fixing
        them from this write when it is the layer's first (the layer joins ``unsettled``), and
        its open heads this write reaches; a write of no tokens fixes nothing.
        NonFiniteKVError, nothing stored or fixed, when ``k`` or ``v`` holds NaN or +-inf. With
        ``defer_non_finite`` (tensor parallelism) the first message is kept in ``non_finite``
        and those elements are stored as 0 (the step is refused after its forward)."""
        for name, x in (("K", k), ("V", v)):
            if not bool(torch.isfinite(x).all()):
                what = "NaN" if bool(torch.isnan(x).any()) else "+-inf"
                message = (f"layer {layer}'s {name} holds {what}, which a "
                           f"{self.encoding.name} cache cannot store (the model's "
                           f"forward made it: an overflow, NaN weights)")
                if not self.defer_non_finite:
                    raise NonFiniteKVError(message)
                self.non_finite = self.non_finite or message
                k, v = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (k, v))
        if k.numel() and not self.fixed[layer]:   # a write of no tokens has no amax
            for table, x in ((self.k, k), (self.v, v)):   # 0: the head stays open
                table[layer] = _head_amax(x) / self.encoding.max_value
            self.fixed[layer] = True
            self.unsettled.append(layer)
            self.maybe_open.add(layer)
        elif k.numel() and layer in self.maybe_open:
            self._fix_open_heads(layer, k, v)
        return (self.encoding.quantize(k, _nonzero(self.k[layer])),
                self.encoding.quantize(v, _nonzero(self.v[layer])))

    def _fix_open_heads(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fix ``layer``'s open heads (scale 0) this write reaches; the others stay open."""
        fixed = []
        for table, x in ((self.k, k), (self.v, v)):
            scale = _head_amax(x) / self.encoding.max_value
            heads = (table[layer] == 0) & (scale > 0)
            table[layer] = torch.where(heads, scale, table[layer])
            fixed.append(heads)
        if bool((fixed[0] | fixed[1]).any()):
            self.unsettled_heads.append((layer, *fixed))
        if bool(self.k[layer].all()) and bool(self.v[layer].all()):   # no scale 0 left
            self.maybe_open.discard(layer)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with 1.0 for 0 (an open head's, to encode its all-0 K/V with: 0 / 0 is NaN)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


CHECKPOINT_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")   # on an attention module
CHECKPOINT_ZERO_POINT_NAMES = ("k_zero_point", "v_zero_point", "kv_zero_point")   # refused


def checkpoint_kv_scales(model: torch.nn.Module, encoding: KVEncoding, num_layers: int,
                         num_kv_heads: int) -> Optional[KVScales]:
    """The scales ``model``'s checkpoint carries, for ``encoding``, or None if none are carried.

    Read from the modules with an int ``layer_idx`` that hold tensor ``k_scale`` and ``v_scale``,
    or one ``kv_scale`` (older fp8 checkpoints): a scalar (any shape of one element; broadcast to
    the layer's KV heads) or ``num_kv_heads`` values (``[H]``, ``[H, 1, 1]``). They keep their
    clip point: scale x the checkpoint's format max (``checkpoint_format_max``) = new scale x
    ``encoding.max_value``, so fp8 scales serve int8 unsaturated. CacheConfigError naming the
    module and attribute for a ``k_zero_point`` / ``v_zero_point`` / ``kv_zero_point`` on any
    module, any other shape, a value not finite and > 0, another set of names, a module without
    ``layer_idx``, two modules of one layer, or layers that carry none while others do."""
    rows = {}   # layer -> (module name, k row, v row)
    for name, module in model.named_modules():
        held = {a: t for a in CHECKPOINT_SCALE_NAMES
                if isinstance(t := getattr(module, a, None), torch.Tensor)}
        _refuse_zero_points(name, module)
        if not held:
            continue
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise CacheConfigError(f"{name} carries {', '.join(held)} but its layer_idx is "
                                   f"{layer!r}, not a layer in [0, {num_layers})")
        if layer in rows:
            raise CacheConfigError(f"{name} and {rows[layer][0]} both carry KV scales of layer "
                                   f"{layer}")
        rows[layer] = (name, *_pair(name, held, num_kv_heads))
    if not rows:
        return None
    missing = [i for i in range(num_layers) if i not in rows]
    if missing:
        raise CacheConfigError(f"the checkpoint carries KV scales for layers {sorted(rows)} but "
                               f"not for layers {missing}; give kv_scales for every layer")
    ratio = checkpoint_format_max(model) / encoding.max_value   # 1.0: the same format
    return KVScales.of([[s * ratio for s in rows[i][1]] for i in range(num_layers)],
                       [[s * ratio for s in rows[i][2]] for i in range(num_layers)])


def checkpoint_format_max(model: torch.nn.Module) -> float:
    """The largest stored value of the format the checkpoint's KV scales were made for: its
    compressed-tensors ``quantization_config.kv_cache_scheme`` (``type`` float: e4m3's 448,
    int: 127), else 448 (fp8 e4m3, vLLM's convention). CacheConfigError naming the field for
    a scheme other than 8 bits, ``symmetric`` false or ``dynamic`` true / "local"."""
    qc = _as_dict(getattr(model.config, "quantization_config", None))
    scheme = _as_dict(qc.get("kv_cache_scheme")
                      or _as_dict(qc.get("quantization_config")).get("kv_cache_scheme"))
    if not scheme:
        return _FIXED["fp8_e4m3"].max_value
    kind, bits = scheme.get("type"), scheme.get("num_bits")
    if bits != 8 or kind not in ("float", "int"):
        raise CacheConfigError(f"the checkpoint's kv_cache_scheme is {kind!r} with {bits!r} "
                               f"bits; its KV scales are read for 8-bit float or int only")
    symmetric, dynamic = scheme.get("symmetric"), scheme.get("dynamic")
    if symmetric is not None and symmetric is not True:
        raise CacheConfigError(f"the checkpoint's kv_cache_scheme.symmetric is {symmetric!r}: "
                               f"its KV scales go with zero points (x / scale + zero point), "
                               f"which this cache does not store; give kv_scales, or use a "
                               f"symmetric checkpoint")
    if dynamic is not None and dynamic is not False:
        raise CacheConfigError(f"the checkpoint's kv_cache_scheme.dynamic is {dynamic!r}: "
                               f"its KV scales are computed per token at run time, so the fixed "
                               f"ones it carries are not them; give kv_scales, or use a static "
                               f"(dynamic: false) checkpoint")
    return _FIXED["fp8_e4m3" if kind == "float" else "int8"].max_value


def _refuse_zero_points(name: str, module: torch.nn.Module) -> None:
    """CacheConfigError naming ``name``.attribute when the module holds a KV zero point
    (asymmetric: stored = x / scale + zero point, which this cache does not store)."""
    points = [a for a in CHECKPOINT_ZERO_POINT_NAMES
              if isinstance(getattr(module, a, None), torch.Tensor)]
    if points:
        raise CacheConfigError(f"{name}.{points[0]}: the checkpoint's KV cache is quantized "
                               f"with zero points (asymmetric), which this cache does not "
                               f"store; give kv_scales, or use a symmetric checkpoint")


def _as_dict(x) -> dict:
    """A config section (a dict, transformers' config object or a pydantic model) as a dict."""
    if x is None or isinstance(x, dict):
        return x or {}
    for method in ("to_dict", "model_dump"):
        if hasattr(x, method):
            return getattr(x, method)()
    return vars(x)


def _pair(name: str, held: dict, num_kv_heads: int) -> tuple:
    """(k row, v row) of one module's ``held`` scale tensors, each ``num_kv_heads`` floats."""
    if set(held) == {"k_scale", "v_scale"}:
        pair = (("k_scale", held["k_scale"]), ("v_scale", held["v_scale"]))
    elif set(held) == {"kv_scale"}:
        pair = (("kv_scale", held["kv_scale"]),) * 2
    else:
        raise CacheConfigError(f"{name} carries {', '.join(held)}; a checkpoint's KV scales are "
                               f"k_scale and v_scale, or kv_scale alone")
    return tuple(_row(f"{name}.{attr}", t, num_kv_heads) for attr, t in pair)


def _row(where: str, t: torch.Tensor, num_kv_heads: int) -> tuple:
    """``t`` as ``num_kv_heads`` floats: one value broadcast, or one per KV head."""
    values = t.detach().float().cpu().reshape(-1).tolist()
    per_head = t.dim() >= 1 and t.shape[0] == num_kv_heads and all(d == 1 for d in t.shape[1:])
    if len(values) != 1 and not per_head:
        raise CacheConfigError(f"{where} has shape {list(t.shape)}; a checkpoint's KV scale "
                               f"must be a scalar or [{num_kv_heads}] (one per KV head)")
    bad = [(j, s) for j, s in enumerate(values) if not _usable(s)]
    if bad:
        raise CacheConfigError(f"{where}[{bad[0][0]}] must be a finite number > 0, got "
                               f"{bad[0][1]!r}")
    return tuple(values * num_kv_heads if len(values) == 1 else values)
