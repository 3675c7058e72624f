"""Hugging Face transformers integration (the ``hf`` extra): unmodified HF models on our caches.

    runtime.hf.attention   the "vmemkv" attention function, registered with transformers'
                           AttentionInterface; the engine runs packed batches through it
    runtime.hf.cache       a transformers ``Cache`` subclass for plain ``model.generate``

Imports are lazy: ``import runtime.hf`` never imports transformers; import the submodule you need.
"""
from __future__ import annotations

import importlib

_ATTENTION_NAMES = ("ATTN_IMPLEMENTATION", "register_attention", "use_vmemkv_attention", "StepContext")
_CACHE_NAMES = ("VMemCache", "VMemCacheStats", "BatchTooLargeError", "ContextOverflowError",
                "CacheCapacityError")


def __getattr__(name: str):
    if name in _ATTENTION_NAMES:
        return getattr(importlib.import_module(".attention", __name__), name)
    if name in _CACHE_NAMES:
        return getattr(importlib.import_module(".cache", __name__), name)
    if name in ("attention", "cache"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
