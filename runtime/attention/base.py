"""The attention backend interface: what a backend declares, and the checks ``forward`` runs
before it reads a layer view (views.py says what it may read).
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import torch

from vmemkv.scheduler.layout import CacheKind

from .checks import MAX_CONTEXT_TOKENS, check_scalars
from .errors import AttentionShapeError, UnsupportedError
from .views import ALL_KV_DTYPES, SUPPORTED_DTYPES, LayerView, PagedLayerView, VMemLayerView


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run in this process, and if not, why."""
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class AttentionBackend(ABC):
    """An attention implementation over one layer's KV cache.

    Guarantees of every backend: ``forward`` returns a tensor shaped and typed like ``q``;
    it reads only each request's live tokens (views.py's memory-safety contract); it never writes the
    cache. Subclasses declare what they support in the class attributes below.
    """
    name: ClassVar[str]
    devices: ClassVar[frozenset[str]]
    kinds: ClassVar[frozenset[str]]          # cache kinds: "vmem", "paged"
    dtypes: ClassVar[frozenset[torch.dtype]] = SUPPORTED_DTYPES
    supports_kv_starts: ClassVar[bool] = False   # honours BatchLens.kv_starts > 0
    forward_s: float = 0.0   # host seconds spent in forward() by this instance (engine stats);
                             # on CUDA that is launch time, kernels run asynchronously
    layer_features: ClassVar[frozenset[str]] = frozenset()   # of "window", "softcap"
    kv_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()   # K/V dtypes read besides q's
    max_query_heads_per_kv_head: ClassVar[Optional[int]] = None   # None: any group size

    @classmethod
    def available(cls) -> Availability:
        """Whether this backend can run here; subclasses add package / device checks."""
        return Availability(True)

    def supports(self, kind: str, device: str) -> bool:
        """Whether this backend reads a ``kind`` cache ("vmem" or "paged") on ``device``."""
        return kind in self.kinds and device in self.devices

    def forward(self, q: torch.Tensor, view: LayerView, scale: Optional[float] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        """Attention of packed ``q`` ``[tokens, heads, head_dim]`` over ``view``; same shape as q.

        ``scale`` defaults to ``1 / sqrt(head_dim)``; ``softcap`` (the layer's logit soft-cap)
        replaces ``view.softcap`` when given. Adds its host time to ``forward_s``.
        """
        start = time.perf_counter()
        for name, value in (("scale", scale), ("softcap", softcap)):
            if isinstance(value, (bool, str, bytes)):   # True was scale 1.0, "0.5" was 0.5
                raise AttentionShapeError(f"{name} must be a number or None, got {value!r}")
        if softcap is not None:
            view = replace(view, softcap=float(softcap))
        if type(view.window) is int and view.window >= MAX_CONTEXT_TOKENS:   # checked in validate
            view = replace(view, window=None)   # wider than any context: every key is in it
            # (2**64 + 1 reached cpu-varlen's int64 as 1, and the reference's arange overflowed)
        self._check_supported(q, view)
        view.validate(q)
        if view.lens.has_kv_starts and not self.supports_kv_starts:
            raise UnsupportedError(f"attention backend {self.name!r} does not implement kv_starts "
                                   f"(a per-sequence first key); got {list(view.lens.kv_starts)}")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        check_scalars(scale, None)
        if scale < 0:   # exact: (-q).k equals -(q.k) bit for bit; causal SDPA (CPU) took its
            q, scale = -q, -scale   # running max over unscaled scores, so rows came out NaN
        if not q.shape[0]:   # an empty batch: no rows (flash's packed metadata took max([]))
            out = torch.empty_like(q)
        elif view.kind is CacheKind.VMEM:
            out = self._forward_vmem(q, view, scale)
        else:
            out = self._forward_paged(q, view, scale)
        self.forward_s += time.perf_counter() - start
        return out

    def check_runs(self, kind: str, device: str, dtype: torch.dtype, what: str = "q",
                   kv_dtype: Optional[torch.dtype] = None) -> None:
        """Raise :class:`UnsupportedError` unless this backend reads a ``kind`` cache on
        ``device`` (a device type) in ``dtype``; ``what`` names whose dtype it is; ``kv_dtype``:
        the cache's storage dtype when it differs from ``dtype`` (``kv_cache_dtype``)."""
        self._check_kv_dtype(dtype, kv_dtype, what)
        if not self.supports(kind, device):
            raise UnsupportedError(
                f"attention backend {self.name!r} runs cache kinds {sorted(self.kinds)} on "
                f"devices {sorted(self.devices)}; got cache kind {kind!r} on {device!r}")
        if dtype not in self.dtypes:
            raise UnsupportedError(f"attention backend {self.name!r} takes dtypes "
                                   f"{sorted(str(d) for d in self.dtypes)}; {what} is {dtype}")

    def _check_kv_dtype(self, dtype, kv_dtype, what: str) -> None:
        if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in ALL_KV_DTYPES:
            # float64, uint8, fp8 "fnuz": no backend reads them (this named cpu-varlen as one)
            raise UnsupportedError(
                f"attention backend {self.name!r} cannot read a cache of {kv_dtype}: no backend "
                f"reads one; K/V dtypes: {', '.join(sorted(str(d) for d in ALL_KV_DTYPES))}")
        if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in self.kv_dtypes:
            raise UnsupportedError(
                f"attention backend {self.name!r} reads K/V only in {what}'s dtype ({dtype}), "
                f"the cache holds {kv_dtype} (kv_cache_dtype); backends that read it: "
                f"cpu-varlen, sdpa and reference on the CPU")

    def _check_supported(self, q: torch.Tensor, view: LayerView) -> None:
        self.check_runs(view.kind, q.device.type, q.dtype, kv_dtype=view._cache_tensor().dtype)
        needs = {"window"} if view.window is not None else set()
        needs |= {"softcap"} if view.softcap is not None else set()
        if needs - self.layer_features:
            raise UnsupportedError(f"attention backend {self.name!r} does not implement "
                                   f"{sorted(needs - self.layer_features)} (this layer has "
                                   f"window={view.window}, softcap={view.softcap}); use 'sdpa'")

    @abstractmethod
    def _forward_vmem(self, q: torch.Tensor, view: VMemLayerView, scale: float) -> torch.Tensor: ...

    @abstractmethod
    def _forward_paged(self, q: torch.Tensor, view: PagedLayerView, scale: float) -> torch.Tensor: ...
