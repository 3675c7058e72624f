"""vmemkv: virtual-memory KV caches for LLM inference, beside a PagedAttention layout.

One import namespace over three layers (the folders ``vmem/``, ``scheduler/`` and ``runtime/`` of
the source tree, installed as ``vmemkv.vmem``, ``vmemkv.scheduler`` and ``vmemkv.runtime``):

    from vmemkv import Engine, SamplingParams, build_model
    with Engine(build_model("tiny-llama"), cache="vmem") as engine:
        print(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].outputs[0].token_ids)

The names below are imported on first use, so ``import vmemkv`` (and ``vmemkv.scheduler``, which
needs no torch) stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Engine": "vmemkv.runtime.engine",
    "EngineConfig": "vmemkv.runtime.engine",
    "SamplingParams": "vmemkv.runtime.engine",
    "RequestOutput": "vmemkv.runtime.engine",
    "VMemCache": "vmemkv.runtime.hf.cache",
    "build_model": "vmemkv.runtime.models",
    "load_model": "vmemkv.runtime.models",
    "make_kv": "vmemkv.runtime.kv",
    "CacheConfig": "vmemkv.runtime.config",
    "open_driver": "vmemkv.vmem",
    "PagePool": "vmemkv.vmem",
    "VirtualRange": "vmemkv.vmem",
    "make_manager": "vmemkv.scheduler.managers",
    "Scheduler": "vmemkv.scheduler.scheduler",
    "SchedulerConfig": "vmemkv.scheduler.plan",
    "StepPlan": "vmemkv.scheduler.plan",
    "simulate": "vmemkv.scheduler.simulator",
    "SimConfig": "vmemkv.scheduler.simulator",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vmemkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
