"""An adapter's weights ready to compute, and their flat layout in caller-provided bytes.

    buffer (1-D uint8, e.g. pool pages):
    | A(m0) pad | B(m0) pad | A(m1) pad | B(m1) pad | ...  modules in sorted name order
    ^ 0         ^ each tensor starts at a multiple of ALIGN_BYTES; num_bytes is rounded up too

Each A [r, in] and B [out, r] is stored in its module's dtype (the base weight's), so a view of
the buffer is the tensor the forward computes with: no copy, no cast per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

import torch

from .errors import LoraBufferError

ALIGN_BYTES = 64
Shape = Tuple[int, ...]


@dataclass(frozen=True)
class ModuleLora:
    """One module's LoRA: ``delta = scale * (x @ a.T) @ b.T`` with a [r, in], b [out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """An adapter's weights by module name (only the modules it targets); ``digest`` is the
    adapter's content digest. Compared by identity: a batch groups rows by this object."""

    digest: str
    modules: Mapping[str, ModuleLora]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the buffer: byte offset, shape, dtype."""

    offset_bytes: int
    shape: Shape
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor over ``buffer``'s bytes (zero-copy)."""
        raw = buffer[self.offset_bytes:self.offset_bytes + self.num_bytes]
        return raw.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    """Every module's (A slot, B slot) and the bytes they span, padding included."""

    slots: Mapping[str, Tuple[TensorSlot, TensorSlot]]
    num_bytes: int

    @classmethod
    def plan(cls, shapes: Mapping[str, Tuple[Shape, Shape, torch.dtype]]) -> "FlatLayout":
        """Lay out ``{module: (a_shape, b_shape, dtype)}`` in sorted module order."""
        slots: Dict[str, Tuple[TensorSlot, TensorSlot]] = {}
        offset_bytes = 0
        for module in sorted(shapes):
            a_shape, b_shape, dtype = shapes[module]
            a = TensorSlot(offset_bytes, tuple(a_shape), dtype)
            b = TensorSlot(_align(a.offset_bytes + a.num_bytes), tuple(b_shape), dtype)
            slots[module] = (a, b)
            offset_bytes = _align(b.offset_bytes + b.num_bytes)
        return cls(slots=slots, num_bytes=offset_bytes)

    def check(self, buffer: torch.Tensor, where: str) -> None:
        """Raise ``LoraBufferError`` unless ``buffer`` can hold this layout."""
        if not isinstance(buffer, torch.Tensor):
            raise LoraBufferError(f"{where}: buffer must be a torch.Tensor, got "
                                  f"{type(buffer).__name__}")
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            got = f"{buffer.dtype} of shape {tuple(buffer.shape)}"
            raise LoraBufferError(f"{where}: buffer must be a 1-D torch.uint8 tensor, got {got}")
        if not buffer.is_contiguous() or buffer.data_ptr() % ALIGN_BYTES:
            raise LoraBufferError(f"{where}: buffer must be contiguous and start at a multiple of "
                                  f"{ALIGN_BYTES} bytes (address {buffer.data_ptr():#x})")
        if buffer.numel() < self.num_bytes:
            raise LoraBufferError(f"{where}: buffer holds {buffer.numel()} bytes, the adapter "
                                  f"needs num_bytes={self.num_bytes}")


def _align(offset_bytes: int) -> int:
    return -(-offset_bytes // ALIGN_BYTES) * ALIGN_BYTES

