"""LoRA inside the model's own HF forward: a forward hook on each decoder projection adds the
adapters of the step's rows to the projection's output. With no batch set, a hook returns
nothing and the output is the base module's, bitwise.

    slots = attach_lora(model)
    with slots.batch(LoraBatch([(0, 5, weights_a), (5, 9, None), (9, 12, weights_b)])):
        model(input_ids=...)     # rows: the step's tokens flattened, [B, T] -> B*T rows in order

Rows are grouped by adapter, so each adapter costs one (x @ A.T) @ B.T per module per step
whatever the number of its segments. Hooks, not wrapper modules: parameter names, module types
and the model's forward stay as transformers wrote them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, FrozenSet, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .errors import LoraBatchError
from .weights import AdapterWeights

# the attention and MLP projections of Llama, Qwen2, Mistral, Gemma (and Phi-3's fused ones)
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                         "gate_proj", "up_proj", "down_proj", "gate_up_proj"})
KV_PROJECTIONS = frozenset({"k_proj", "v_proj", "qkv_proj"})   # those whose outputs are K or V
_SLOTS_ATTRIBUTE = "_vmemkv_lora_slots"

Segment = Tuple[int, int, Optional[AdapterWeights]]
Rows = Union[slice, torch.Tensor]   # one contiguous range, or the rows' indices (int64)


def supported_modules(model: nn.Module) -> FrozenSet[str]:
    """Names (as ``model.named_modules()`` gives them) of the modules an adapter may target:
    the ``nn.Linear`` projections with floating-point weights of the decoder's layers (on a
    tensor-parallel shard, a row-parallel projection's ``partial_linear``, under its name)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return frozenset()
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return frozenset(f"{prefix}.{name}" for name, module in layers.named_modules()
                     if name.rsplit(".", 1)[-1] in PROJECTIONS
                     and isinstance(_hooked(module), nn.Linear)
                     and _hooked(module).weight.is_floating_point())


def _hooked(module: nn.Module) -> nn.Module:
    """Where a projection's LoRA hook goes: the module, or on a tensor-parallel shard's
    row-parallel projection its ``partial_linear`` (this rank's sum, before the ranks')."""
    return getattr(module, "partial_linear", module)


class LoraBatch:
    """Which adapter each row of one step runs. ``segments``: (row_start, row_end, weights or
    None), half-open ranges over the step's flattened token rows, not overlapping; rows in no
    segment, or in one with None, run the base model."""

    def __init__(self, segments: Iterable[Segment]) -> None:
        by_adapter: Dict[int, Tuple[AdapterWeights, List[Tuple[int, int]]]] = {}
        spans = []
        for segment in segments:
            start, end, weights = _checked_segment(segment)
            if end == start:
                continue
            spans.append((start, end))
            if weights is not None:
                by_adapter.setdefault(id(weights), (weights, []))[1].append((start, end))
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                raise LoraBatchError(f"LoRA segments overlap: a segment starts at row {start} "
                                     f"before the one before it ends at row {end}")
        self.num_rows = max((end for _, end in spans), default=0)
        self._groups = [(weights, _merged(ranges)) for weights, ranges in by_adapter.values()]
        self._rows_by_device: Dict[torch.device, List[Tuple[AdapterWeights, Rows]]] = {}

    @property
    def adapters(self) -> Tuple[AdapterWeights, ...]:
        """The distinct adapters the batch runs (each once)."""
        return tuple(weights for weights, _ in self._groups)

    def rows(self, device: torch.device) -> List[Tuple[AdapterWeights, Rows]]:
        """Per adapter, its rows: a slice when they are one range, else int64 indices on
        ``device`` (built once per batch and device, not per module)."""
        rows = self._rows_by_device.get(device)
        if rows is None:
            rows = [(weights, _rows(spans, device)) for weights, spans in self._groups]
            self._rows_by_device[device] = rows
        return rows


class LoraSlots:
    """The LoRA hooks of one model: the modules adapters may target, and the batch the hooks
    apply now (None between steps: every projection returns its base output unchanged).
    One forward at a time per model, as for its KV cache."""

    def __init__(self, modules: FrozenSet[str]) -> None:
        self.modules = modules
        self._active: Optional[LoraBatch] = None
        self.hooked: Dict[str, nn.Module] = {}   # name -> the module its hook is on

    def hooks_in_place(self, model: nn.Module) -> bool:
        """Whether every hook is still on ``model``'s module of its name (not so on a copy
        whose projections were replaced, such as a tensor-parallel shard)."""
        return self.modules == supported_modules(model) and all(
            _hooked(model.get_submodule(name)) is module for name, module in self.hooked.items())

    @property
    def active(self) -> Optional[LoraBatch]:
        return self._active

    @contextmanager
    def batch(self, lora_batch: LoraBatch) -> Iterator[LoraBatch]:
        """Apply ``lora_batch`` to the forwards run inside; the previous batch after."""
        for weights in lora_batch.adapters:
            unknown = sorted(set(weights.modules) - self.modules)
            if unknown:
                raise LoraBatchError(f"adapter {weights.digest[:12]} targets modules this model "
                                     f"does not adapt: {', '.join(unknown[:4])}")
        previous, self._active = self._active, lora_batch
        try:
            yield lora_batch
        finally:
            self._active = previous


def attach_lora(model: nn.Module) -> LoraSlots:
    """Hook every supported projection of ``model`` (idempotent: a second call returns the
    same slots). Without an active batch the model computes exactly what it did before.
    A copy of a hooked model (``copy.deepcopy``, pickling) carries copies of the slots and
    hooks; they are kept while every hook is still on the copy's module, else (a shard whose
    projections were replaced) the copy is hooked anew, its stale hooks never given a batch."""
    slots = getattr(model, _SLOTS_ATTRIBUTE, None)
    if slots is None or not slots.hooks_in_place(model):
        slots = LoraSlots(supported_modules(model))
        for name in sorted(slots.modules):
            module = _hooked(model.get_submodule(name))
            module.register_forward_hook(_LoraHook(name, slots), with_kwargs=True)
            slots.hooked[name] = module
        setattr(model, _SLOTS_ATTRIBUTE, slots)
    return slots


class _LoraHook:
    """Adds ``scale * (x[rows] @ A.T) @ B.T`` of each adapter of the active batch to the
    output rows of module ``name``, in place, in the module's dtype. On a tensor-parallel
    shard the module holds a slice (runtime/distributed/sharding.py) and so do the weights it
    is given (``LoraAdapter.sliced``): B's rows of a column-parallel module's outputs
    (``lora_out_rows``), A's columns of a row-parallel one's inputs (``lora_in_cols``), whose
    partial sums the ranks add."""

    def __init__(self, name: str, slots: LoraSlots) -> None:
        self.name = name
        self.slots = slots

    def __call__(self, module, args, kwargs, output):
        batch = self.slots.active
        if batch is None:
            return None
        x = args[0] if args else kwargs["input"]
        x_rows = x.reshape(-1, x.shape[-1])               # [N, in]
        out_rows = output.view(-1, output.shape[-1])      # [N, out], output's memory
        if batch.num_rows > x_rows.shape[0]:
            raise LoraBatchError(f"LoRA segments reach row {batch.num_rows}, the step has "
                                 f"{x_rows.shape[0]} rows")
        for weights, rows in batch.rows(x.device):
            lora = weights.modules.get(self.name)
            if lora is None:
                continue
            _check_fits(self.name, weights.digest, lora, x_rows, out_rows)
            delta = ((x_rows[rows] @ lora.a.T) * lora.scale) @ lora.b.T   # [n, r] -> [n, out]
            if isinstance(rows, slice):
                out_rows[rows] += delta
            else:
                out_rows.index_add_(0, rows, delta)
        return output


def _check_fits(name: str, digest: str, lora, x_rows: torch.Tensor,
                out_rows: torch.Tensor) -> None:
    """LoraBatchError unless A [r, in] and B [out, r] fit this module's rows: its input and
    output widths, dtype and device (weights loaded for another model, or its other dtype,
    were a raw RuntimeError from the matmul)."""
    fits = (lora.a.shape[1] == x_rows.shape[1] and lora.b.shape[0] == out_rows.shape[1]
            and lora.a.dtype == lora.b.dtype == x_rows.dtype
            and lora.a.device == lora.b.device == x_rows.device)
    if not fits:
        raise LoraBatchError(
            f"adapter {digest[:12]}'s {name}: A {tuple(lora.a.shape)} and B "
            f"{tuple(lora.b.shape)} ({lora.a.dtype} on {lora.a.device}) do not fit the module's "
            f"{x_rows.shape[1]} inputs and {out_rows.shape[1]} outputs ({x_rows.dtype} on "
            f"{x_rows.device}): the weights were loaded for another model or dtype")


def _checked_segment(segment) -> Segment:
    try:
        start, end, weights = segment
    except (TypeError, ValueError):
        raise LoraBatchError(f"a LoRA segment is (row_start, row_end, weights or None), got "
                             f"{segment!r}") from None
    if not (_is_index(start) and _is_index(end) and 0 <= start <= end):
        raise LoraBatchError(f"LoRA segment rows must satisfy 0 <= row_start <= row_end, got "
                             f"({start!r}, {end!r})")
    if weights is not None and not isinstance(weights, AdapterWeights):
        raise LoraBatchError(f"a LoRA segment's weights are AdapterWeights or None, got "
                             f"{type(weights).__name__}")
    return start, end, weights


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _merged(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Sorted ranges with adjacent ones joined: (0, 4), (4, 9) -> (0, 9)."""
    merged: List[Tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _rows(spans: List[Tuple[int, int]], device: torch.device) -> Rows:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(start, end) for start, end in spans]).to(device)
