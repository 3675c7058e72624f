"""Attention backends by name, imported lazily: naming a backend never imports another one's deps.

    get_backend("sdpa").forward(q, view)          # raises a typed error if it cannot run
    fastest_backend("vmem", "cuda")               # by cache kind and device: what benchmarks use
"""
from __future__ import annotations

import importlib
import inspect
from typing import Optional

from vmemkv.scheduler.layout import CacheKind

from .base import AttentionBackend, Availability
from .errors import BackendUnavailableError, UnknownBackendError, UnsupportedError

# name -> (module, class); the module is imported on first use only.
_BACKENDS: dict[str, tuple[str, str]] = {
    "reference": ("vmemkv.runtime.attention.reference", "ReferenceBackend"),
    "sdpa": ("vmemkv.runtime.attention.sdpa", "SdpaBackend"),
    "cpu-varlen": ("vmemkv.runtime.attention.cpu_varlen", "CpuVarlenBackend"),
    "flash": ("vmemkv.runtime.attention.flash", "FlashBackend"),
    "flash-attn": ("vmemkv.runtime.attention.flash_attn_pkg", "FlashAttnBackend"),
}


def backend_names() -> list[str]:
    return list(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name`` (imports its module; not its optional deps)."""
    if name not in _BACKENDS:
        raise UnknownBackendError(name, backend_names())
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def availability(name: str) -> Availability:
    return backend_class(name).available()


def get_backend(name: str, **options) -> AttentionBackend:
    """A ready backend instance; raises :class:`BackendUnavailableError` saying why if it can't run."""
    cls = backend_class(name)
    avail = cls.available()
    if not avail:
        raise BackendUnavailableError(name, avail.reason)
    takes = inspect.signature(cls).parameters
    if set(options) - set(takes):   # was a bare TypeError from the constructor
        raise UnsupportedError(f"attention backend {name!r} takes options {sorted(takes) or 'none'}; "
                               f"got {sorted(set(options) - set(takes))}")
    return cls(**options)


def describe_backends() -> list[dict]:
    """One row per backend: name, devices, cache kinds, available, reason (for `vmemkv info`)."""
    rows = []
    for name in backend_names():
        cls, avail = backend_class(name), availability(name)
        rows.append({"name": name, "devices": sorted(cls.devices), "kinds": sorted(cls.kinds),
                     "available": avail.ok, "reason": avail.reason})
    return rows


# Preference order per (kind, device); the first available one wins. flash-attn needs paged
# blocks that are multiples of 256 tokens, so it is skipped for paged with smaller blocks.
_PREFERENCE = {
    ("vmem", "cuda"): ["flash-attn", "flash", "sdpa"],
    ("paged", "cuda"): ["flash-attn", "flash", "sdpa"],
    ("vmem", "cpu"): ["cpu-varlen", "sdpa"],     # cpu-varlen needs a C compiler (built once)
    ("paged", "cpu"): ["cpu-varlen", "sdpa"],
}


def fastest_backend(kind: str, device: str, block_size: Optional[int] = None,
                    dtype=None, kv_dtype=None, group: Optional[int] = None,
                    features: frozenset = frozenset()) -> str:
    """Name of the fastest available backend for a ``kind`` cache ("vmem" or "paged") on ``device`` ("cpu" or "cuda")
    that takes ``dtype`` (a torch dtype; None: any). FlashAttention-2 has no fp32 kernel, so
    an fp32 model on CUDA gets ``sdpa``; ``kv_dtype``: the cache's storage dtype when it is
    not ``dtype`` (kv_cache_dtype), which the backend must read (``AttentionBackend.kv_dtypes``);
    ``group``: query heads per KV head, which it must take (cpu-varlen: 64 at most; a 71/1 model
    was refused by the engine's self-check, naming the kernel, where sdpa runs it);
    ``features``: the model's layer features ("window", "softcap") it must implement
    (flash-attn has neither: a sliding-window model got it and every windowed layer refused)."""
    device = device.split(":")[0]
    if (kind, device) not in _PREFERENCE:
        raise UnsupportedError(f"no attention backend for cache kind {kind!r} on device {device!r}; "
                               f"kinds: vmem, paged; devices: cpu, cuda")
    skipped = []   # (name, why) of each candidate passed over
    for name in _PREFERENCE[(kind, device)]:
        cls = backend_class(name)
        if name == "flash-attn" and kind == CacheKind.PAGED and block_size is not None and block_size % 256:
            skipped.append((name, f"paged block_size={block_size} is not a multiple of 256"))
        elif dtype is not None and dtype not in cls.dtypes:
            skipped.append((name, f"takes no dtype={dtype}"))
        elif kv_dtype not in (None, dtype) and kv_dtype not in cls.kv_dtypes:
            skipped.append((name, f"reads no kv_dtype={kv_dtype}"))
        elif set(features) - cls.layer_features:
            skipped.append((name, f"implements no {sorted(set(features) - cls.layer_features)}"))
        elif group is not None and cls.max_query_heads_per_kv_head is not None \
                and group > cls.max_query_heads_per_kv_head:
            skipped.append((name, f"takes at most {cls.max_query_heads_per_kv_head} query heads "
                                  f"per KV head, group={group}"))
        elif not availability(name):
            skipped.append((name, availability(name).reason))
        else:
            return name
    why = "; ".join(f"{name}: {reason}" for name, reason in skipped)
    if all(not availability(name) for name, _ in skipped):
        raise BackendUnavailableError(skipped[-1][0], why)
    raise UnsupportedError(f"no attention backend for cache kind {kind!r} on {device!r} computes "
                           f"this configuration ({why})")
