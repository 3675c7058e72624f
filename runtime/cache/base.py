"""The interface both cache layouts share, and the per-step batch they index with.

A step, from the runtime's side:

    cache.execute(plan.ops)            # map/unmap/copy/swap exactly as the manager planned
    cache.begin_step(plan_sequences)   # (seq_id, num_computed_tokens, num_new_tokens) each
    for layer in range(num_layers):
        cache.write(layer, k_new, v_new)            # packed [new_tokens, kv_heads, head_dim]
        out = backend.forward(q, cache.layer_view(layer))

The manager owns all allocation state; a cache keeps only what it needs to execute it (the
driver's mappings, its tensors, the host copies of swapped sequences).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from runtime.attention.base import BatchLens, LayerView
from scheduler.managers.base import SwapIn, SwapOut

from ..config import CacheConfig
from ..errors import CacheStateError


@dataclass(frozen=True)
class StepBatch:
    """The sequences of one step, in the order their tokens are packed in q, k and v."""
    seq_ids: tuple[int, ...]
    lens: BatchLens                 # context lens include this step's new tokens
    positions: torch.Tensor         # int64 [new_tokens]: position of each new token
    token_seq_index: torch.Tensor   # int64 [new_tokens]: which sequence each token belongs to
    context_lens: torch.Tensor      # int32 [batch] on the cache device
    query_lens: torch.Tensor        # int32 [batch] on the cache device

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, int]], device: torch.device) -> "StepBatch":
        """``seqs``: (seq_id, num_computed_tokens, num_new_tokens) per sequence."""
        seq_ids = tuple(s[0] for s in seqs)
        if len(set(seq_ids)) != len(seq_ids):
            raise CacheStateError(f"a step lists a sequence twice: {list(seq_ids)}")
        positions, owners = [], []
        for index, (_, computed, new) in enumerate(seqs):
            if computed < 0 or new < 1:
                raise CacheStateError(f"sequence {seqs[index][0]}: need num_computed_tokens >= 0 "
                                      f"and num_new_tokens >= 1, got {computed} and {new}")
            positions.extend(range(computed, computed + new))
            owners.extend([index] * new)
        context = tuple(c + n for _, c, n in seqs)
        query = tuple(n for _, _, n in seqs)
        starts, acc = [], 0
        for n in query:
            starts.append(acc)
            acc += n
        return cls(seq_ids, BatchLens(context, query, tuple(starts)),
                   torch.tensor(positions, dtype=torch.int64, device=device),
                   torch.tensor(owners, dtype=torch.int64, device=device),
                   torch.tensor(context, dtype=torch.int32, device=device),
                   torch.tensor(query, dtype=torch.int32, device=device))


class KVCache(ABC):
    """A KV cache that executes a memory manager's plans on real memory.

    Guarantees: after ``execute(ops)`` the memory matches the manager's tables; ``write`` only
    stores into memory the manager holds for the step's sequences (it checks, and raises
    CacheStateError rather than fault); ``layer_view`` hands attention exactly the live tokens.
    """

    layout: str
    config: CacheConfig

    def __init__(self, config: CacheConfig, manager) -> None:
        self.config = config
        self.manager = manager
        self._step: StepBatch | None = None
        self._swapped: dict[int, torch.Tensor] = {}   # seq_id -> [layers, 2, tokens, kv_heads, head_dim]

    # -- plans --
    @abstractmethod
    def execute(self, ops: Sequence) -> None:
        """Carry out the manager's memory ops, in order."""

    # -- steps --
    def begin_step(self, seqs: Sequence[tuple[int, int, int]]) -> StepBatch:
        """Index this step's sequences; every new token must lie in memory the manager holds."""
        for seq_id, computed, new in seqs:
            held = self.manager.num_tokens(seq_id)
            if computed + new > held:
                raise CacheStateError(
                    f"sequence {seq_id}: writing tokens up to {computed + new} but the manager "
                    f"holds {held}; grow it with the manager (allocate/append) first")
        self._step = StepBatch.build(seqs, self.config.torch_device)
        self._index_step(self._step)
        return self._step

    @abstractmethod
    def _index_step(self, step: StepBatch) -> None:
        """Precompute the layout's write indices and attention metadata for ``step``."""

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's new keys and values ``[new_tokens, kv_heads, head_dim]`` of a layer."""

    @abstractmethod
    def layer_view(self, layer: int) -> LayerView:
        """What an attention backend needs for ``layer`` in the current step."""

    @abstractmethod
    def read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a sequence's first ``num_tokens`` K and V of ``layer`` (for checks)."""

    # -- swap space (host memory) --
    @property
    def swapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._swapped.values())

    def _bind_swaps(self, ops: Sequence) -> list[tuple[object, Optional[torch.Tensor]]]:
        """Pair every op with its host buffer, updating the swap space in plan order.

        SwapOut gets a fresh buffer (registered as the sequence's swapped copy); SwapIn gets
        the sequence's current copy (and drops it from the swap space). Binding up front keeps
        a plan that swaps a sequence in and out again correct when it is applied layer by layer.
        """
        bound = []
        for op in ops:
            buffer = None
            if isinstance(op, SwapOut):
                c = self.config
                buffer = torch.empty((c.num_layers, 2, op.num_tokens, c.num_kv_heads, c.head_dim),
                                     dtype=c.dtype, pin_memory=c.torch_device.type == "cuda")
                self._swapped[op.seq_id] = buffer
            elif isinstance(op, SwapIn):
                buffer = self._swapped.pop(op.seq_id, None)
                if buffer is None:
                    raise CacheStateError(f"sequence {op.seq_id} has no swapped-out data to swap in")
                if buffer.shape[2] != op.num_tokens:
                    raise CacheStateError(f"sequence {op.seq_id}: swapping in {op.num_tokens} "
                                          f"tokens but {buffer.shape[2]} were swapped out")
            bound.append((op, buffer))
        return bound

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise CacheStateError(f"layer {layer} outside 0..{self.config.num_layers - 1}")
        if self._step is None:
            raise CacheStateError("no step begun: call begin_step(...) first")

    def close(self) -> None:
        """Release memory; the cache cannot be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
