"""Attention backends over both KV-cache kinds (vmem, paged), chosen by name through a lazy registry.

    from vmemkv.runtime.attention import get_backend, VMemLayerView
    out = get_backend("sdpa").forward(q, VMemLayerView(k, v, slots, context_lens, query_lens))

Backends: ``reference`` (dense fp32, tests), ``sdpa`` (CPU/CUDA), ``flash`` (CUDA, PyTorch's
FlashAttention-2), ``flash-attn`` (CUDA, the flash-attn package). See docs/attention.md.
"""
from .base import AttentionBackend, Availability
from .errors import (AttentionError, AttentionShapeError, BackendUnavailableError,
                     UnknownBackendError, UnsupportedError)
from .registry import (availability, backend_class, backend_names, describe_backends,
                       fastest_backend, get_backend)
from .views import BatchLens, LayerView, PagedLayerView, StepMeta, VMemLayerView

__all__ = [
    "AttentionBackend", "Availability", "BatchLens", "LayerView", "PagedLayerView", "StepMeta",
    "VMemLayerView",
    "AttentionError", "AttentionShapeError", "BackendUnavailableError", "UnknownBackendError",
    "UnsupportedError", "availability", "backend_class", "backend_names", "describe_backends",
    "fastest_backend", "get_backend",
]
