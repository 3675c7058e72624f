"""CacheConfig: the shape of a KV cache, validated up front.

    per token and layer: K and V each kv_heads * head_dim elements of the storage dtype
                         (``kv_cache_dtype``: the model's dtype, 16-bit, or 8-bit with scales)
    capacity:            max_batch requests of at most max_context tokens each (vmem slots)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vmemkv.scheduler.presets import ModelSpec

from .errors import CacheConfigError, NonFiniteKVError
from .kv_dtype import KVEncoding, KVScales, kv_encoding

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise CacheConfigError(f"CacheConfig.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class CacheConfig:
    """What a cache stores. Every field is checked in ``__post_init__``."""

    num_layers: int            # transformer blocks, each with its own K and V
    num_kv_heads: int          # KV heads (query heads are a multiple of this under GQA)
    head_dim: int              # elements per head
    dtype: torch.dtype = torch.float32   # the model's: what is written, what attention returns
    device: str = "cpu"        # "cpu" or "cuda[:i]" (or a torch.device); the vmem driver
                               # follows it
    max_batch: int = 8         # concurrent requests (vmem: slots, batch rows)
    max_context: int = 2048    # tokens per request, prompt and output together
    layer_windows: tuple = ()  # per layer: sliding window in tokens, or None (full); () = all full
    kv_cache_dtype: str = "auto"   # what the cache stores (runtime/kv_dtype.py); auto: dtype
    kv_scales: Optional[KVScales] = None   # 8-bit: given scales; None: fixed at first write

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not isinstance(self.device, (str, torch.device)):   # b"cpu" was taken by torch
            raise CacheConfigError(f"CacheConfig.device must be 'cpu' or 'cuda[:i]', got "
                                   f"{repr(self.device)[:60]} of type "
                                   f"{type(self.device).__name__} (a str or torch.device "
                                   f"is taken)")
        self._check_encoding()
        object.__setattr__(self, "layer_windows", self._checked_windows())
        limits = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 1024,
                  "max_batch": 1 << 16, "max_context": 1 << 24}
        for name, upper in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
                raise CacheConfigError(f"CacheConfig.{name} must be an int in [1, {upper}], "
                                       f"got {value!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):   # ValueError: an index past int64
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise CacheConfigError(f"CacheConfig.device must be 'cpu' or 'cuda[:i]', got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CacheConfigError(f"CacheConfig.device is {self.device!r} but no CUDA GPU is visible")

    def _check_encoding(self) -> None:
        encoding = kv_encoding(self.kv_cache_dtype, self.dtype)   # names kv_cache_dtype
        scales = self.kv_scales
        if scales is not None:
            if not encoding.scaled:
                raise CacheConfigError(f"CacheConfig.kv_scales apply to fp8_e4m3, fp8_e5m2 and "
                                       f"int8 only; kv_cache_dtype is {self.kv_cache_dtype!r}")
            if not isinstance(scales, KVScales):
                if not isinstance(scales, (tuple, list)) or len(scales) != 2:
                    raise CacheConfigError(f"CacheConfig.kv_scales must be a KVScales or a (k, v) "
                                           f"pair, got {type(scales).__name__}")
                scales = KVScales.of(*scales)
                object.__setattr__(self, "kv_scales", scales)
            scales.check(self.num_layers, self.num_kv_heads)
        if encoding.scaled and str(self.device).startswith("cuda"):
            # PyTorch's FlashAttention reads no 8-bit K/V (docs/attention.md)
            raise CacheConfigError(f"CacheConfig.kv_cache_dtype {self.kv_cache_dtype!r} runs on "
                                   f"the CPU only (no CUDA attention reads 8-bit K/V); use auto, "
                                   f"bf16 or fp16 on {self.device!r}")

    def _checked_windows(self) -> tuple:
        windows = self.layer_windows
        if not isinstance(windows, (tuple, list)) or windows and len(windows) != self.num_layers:
            raise CacheConfigError(f"CacheConfig.layer_windows must be () or one entry per layer "
                                   f"({self.num_layers}), got {windows!r}")
        for layer, w in enumerate(windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise CacheConfigError(f"CacheConfig.layer_windows[{layer}] must be None or an "
                                       f"int >= 1 (tokens), got {w!r}")
        return tuple(windows) if any(w is not None for w in windows) else ()

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer`` in tokens, or None for a full-attention layer."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def window_tokens(self) -> Optional[int]:
        """The window every layer attends within (the widest), None if any layer is full:
        keys older than it are read by no layer (``ModelSpec.window_tokens``)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    @property
    def kv_encoding(self) -> KVEncoding:
        """How K and V are stored (``runtime.kv_dtype``)."""
        return kv_encoding(self.kv_cache_dtype, self.dtype)

    def check_storable(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V an unscaled storage narrower than the model's dtype cannot hold: fp16
        (``kv_cache_dtype="fp16"``) of a bf16 or fp32 model stored a value past 65504 as inf,
        and attention returned NaN (transformers' generate then picked token 0, unsaid; the
        engine failed the request on its logits, blaming the model). NonFiniteKVError naming
        the largest value, before anything is written; one amax per write, in that
        configuration only (8-bit encodings refuse non-finite K/V themselves)."""
        encoding = self.kv_encoding
        if encoding.scaled or not encoding.storage.is_floating_point:
            return
        largest = torch.finfo(encoding.storage).max
        if largest >= torch.finfo(self.dtype).max:
            return
        for name, t in (("key", k), ("value", v)):
            amax = float(t.abs().amax()) if t.numel() else 0.0
            if amax > largest:      # (NaN compares False: the model's own, DynamicCache keeps it)
                raise NonFiniteKVError(
                    f"{name} states hold {amax:g}, past {largest:g}, the largest value a "
                    f"kv_cache_dtype={self.kv_cache_dtype!r} cache stores (it would store inf: "
                    f"NaN attention); nothing was written: store the model's {self.dtype} "
                    f"(kv_cache_dtype='auto') or a scaled 8-bit encoding")

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the cache's tensors (and of its swap buffers)."""
        return self.kv_encoding.storage

    @property
    def element_bytes(self) -> int:
        """Bytes of one stored K or V element (every capacity figure follows it)."""
        return self.kv_encoding.element_bytes

    @property
    def prefix_tag(self) -> str:
        """The encoding as the prefix cache keys it: "" for the model's own dtype, else the
        name and the scales (given: their digest; else fixed at each layer's first write, once
        per cache, so within one cache's prefix index they are one encoding)."""
        enc = self.kv_encoding
        if enc.storage == self.dtype:
            return ""
        if not enc.scaled:
            return enc.name
        return f"{enc.name}/{self.kv_scales.digest if self.kv_scales else 'first-write'}"

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes of one layer's K (or V) for one token."""
        return self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.layer_bytes_per_token

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def model_spec(self, name: str = "runtime", weight_bytes: int = 0) -> ModelSpec:
        """The scheduler's view of this cache's shape (for building a memory manager)."""
        return ModelSpec(name, self.num_layers, self.num_kv_heads, self.head_dim,
                         self.element_bytes, weight_bytes=weight_bytes,
                         layer_windows=self.layer_windows, kv_encoding=self.prefix_tag)


def check_cache_config(config, who: str) -> CacheConfig:
    """``config`` when it is a CacheConfig, else CacheConfigError naming ``who``'s argument (a
    name or None failed inside as an AttributeError or dataclasses' TypeError)."""
    if not isinstance(config, CacheConfig):
        raise CacheConfigError(f"{who} needs config, a CacheConfig (the cache's shape: "
                               f"CacheConfig(num_layers=..., num_kv_heads=..., head_dim=...)), "
                               f"got {type(config).__name__} {repr(config)[:60]}")
    return config
