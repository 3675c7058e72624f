"""Model and device presets: the numbers the cost model and the managers derive everything from.

Bytes per token counts K and V over all layers: 2 * layers * kv_heads * head_dim * dtype_bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a model's KV cache and the size of its weights."""

    name: str
    num_layers: int          # transformer blocks, each with its own K and V
    num_kv_heads: int        # KV heads (GQA: fewer than query heads)
    head_dim: int            # elements per head
    dtype_bytes: int         # 2 for fp16/bf16, 4 for fp32
    weight_bytes: int        # bytes read per decode step for the weights
    num_params: int = 0      # parameters, for compute-bound prefill costing (0: derive from weights)
    layer_windows: tuple = ()  # per layer: sliding window in tokens or None (full); () = all full
    kv_encoding: str = ""    # how K/V are stored when not in the model's dtype (prefix-cache key)

    def __post_init__(self) -> None:
        # the counts first: a bad num_layers was reported as layer_windows not one per layer
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelSpec.{field} must be a positive int, got {value!r}")
        weight = self.weight_bytes
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
            raise ConfigError(f"ModelSpec.weight_bytes must be an int >= 0, got {weight!r}")
        windows = self.layer_windows
        if windows and (len(windows) != self.num_layers or any(
                w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1)
                for w in windows)):
            raise ConfigError(f"ModelSpec.layer_windows must be () or one None / int >= 1 per "
                              f"layer ({self.num_layers}), got {windows!r}")

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes of ONE layer's K (or V) for one token."""
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.layer_bytes_per_token

    @property
    def window_tokens(self) -> Optional[int]:
        """The sliding window every layer attends within (the widest, when they differ), or
        None when any layer attends to all tokens: a token older than this window is read by no
        layer, so the memory holding it for ALL layers can be given back."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    @property
    def windowed_layers(self) -> int:
        """Layers with a sliding window."""
        return sum(w is not None for w in self.layer_windows)

    @property
    def is_hybrid(self) -> bool:
        """Full-attention layers beside sliding-window ones (Gemma 2/3, Cohere2): the vmem
        per-layer layout then splits each page group by layer kind (managers/vmem_kinds.py)."""
        return None in self.layer_windows and self.windowed_layers > 0

    @property
    def local_window_tokens(self) -> Optional[int]:
        """The widest window among the windowed layers (tokens), None without one: keys older
        than it are read by no windowed layer (a hybrid model's full layers still read them)."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def params(self) -> int:
        return self.num_params or self.weight_bytes // self.dtype_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """Roofline numbers of an accelerator."""

    name: str
    memory_bandwidth_bytes_per_s: float
    peak_flops_per_s: float   # dense fp16/bf16 tensor-core peak
    memory_bytes: int


# kv_cache_dtype: bytes per stored K/V element (None: the model's own dtype_bytes); the codec
# of each is runtime/kv_dtype.py
KV_CACHE_DTYPE_BYTES: dict = {"auto": None, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
                              "int8": 1}
KV_CACHE_DTYPES = tuple(KV_CACHE_DTYPE_BYTES)


def with_kv_cache_dtype(model: ModelSpec, kv_cache_dtype: str) -> ModelSpec:
    """``model`` whose cache stores ``kv_cache_dtype`` (bytes per token follow it; the weights,
    and so the parameter count, stay); ConfigError for an unknown name."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                          f"{kv_cache_dtype!r}")
    size = KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    if size is None or size == model.dtype_bytes:
        return model
    return replace(model, dtype_bytes=size, num_params=model.params,
                   kv_encoding=kv_cache_dtype)


MODELS: dict[str, ModelSpec] = {
    # 32 layers * 8 KV heads * 128 dims * 2 bytes * 2 (K,V) = 131,072 B = 128 KiB per token
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 8, 128, 2, weight_bytes=16_060_000_000,
                            num_params=8_030_000_000),
    # OPT-13B: 40 layers, 40 heads (MHA) * 128 dims * 2 bytes * 2 = 819,200 B = 800 KiB per token
    "opt-13b": ModelSpec("opt-13b", 40, 40, 128, 2, weight_bytes=25_700_000_000,
                         num_params=12_850_000_000),
    # Mistral-7B: 32 layers * 8 KV heads * 128 dims * 2 bytes * 2 = 128 KiB per token; v0.1
    # attends within a 4,096-token window on every layer, v0.3 to every token (same shape)
    "mistral-7b-v0.1": ModelSpec("mistral-7b-v0.1", 32, 8, 128, 2, weight_bytes=14_480_000_000,
                                 num_params=7_240_000_000, layer_windows=(4096,) * 32),
    "mistral-7b-v0.3": ModelSpec("mistral-7b-v0.3", 32, 8, 128, 2, weight_bytes=14_500_000_000,
                                 num_params=7_250_000_000),
    # Gemma-3-27B (text): 62 layers, 16 KV heads * 128 dims * 2 bytes * 2 = 496 KiB per token;
    # five local layers (1,024-token window) to one global, the global ones at 5, 11, ..., 59
    "gemma-3-27b": ModelSpec("gemma-3-27b", 62, 16, 128, 2, weight_bytes=54_800_000_000,
                             num_params=27_400_000_000,
                             layer_windows=tuple(None if i % 6 == 5 else 1024 for i in range(62))),
    # Phi-2 (microsoft/phi-2): 32 layers, 32 KV heads (MHA) * 80 dims * 2 bytes * 2 = 320 KiB
    # per token; 5,120 bytes a layer-token do not divide a 2 MiB page: a page-group member
    # spans 5 pages (2,048 tokens per-layer, 64 interleaved), mapped by bytes
    "phi-2": ModelSpec("phi-2", 32, 32, 80, 2, weight_bytes=5_560_000_000,
                       num_params=2_780_000_000),
    # the engine tests' random-weight model: 4 layers, 2 KV heads, 64 dims, fp32
    "tiny": ModelSpec("tiny", 4, 2, 64, 4, weight_bytes=4 * 8_000_000, num_params=8_000_000),
}

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 3.35e12, 989e12, 80 * 2**30),
    "h200": DeviceSpec("h200", 4.8e12, 989e12, 141 * 10**9),
    "a100-80gb": DeviceSpec("a100-80gb", 2.0e12, 312e12, 80 * 2**30),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}") from None
