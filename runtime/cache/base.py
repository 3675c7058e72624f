"""The interface both cache layouts share, and the per-step batch they index with.

A step, from the runtime's side:

    cache.execute(plan.ops)            # map/unmap/copy/swap exactly as the manager planned
    cache.begin_step(plan_sequences)   # (seq_id, num_computed_tokens, num_new_tokens) each
    for layer in range(num_layers):
        cache.write(layer, k_new, v_new)            # packed [new_tokens, kv_heads, head_dim]
        out = backend.forward(q, cache.layer_view(layer))

To make "mutate the manager, execute its ops" all-or-nothing (a failed map or an OOM rolls both
the cache and the manager back), run it as ``run_plan(manager, cache, mutate)`` (below).

The manager owns all allocation state; a cache keeps only what it needs to execute it (the
driver's mappings, its tensors, the host copies of swapped sequences).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch

from vmemkv.runtime.attention.base import BatchLens, LayerView
from vmemkv.scheduler.managers.base import SwapIn, SwapOut

from ..config import CacheConfig
from ..errors import CacheStateError, PlanExecutionError
from ..memory import check_fits_device, device_memory_bytes  # noqa: F401  (moved; re-exported)

T = TypeVar("T")


class PlanJournal:
    """Undo actions for the part of one plan applied so far, run newest first on failure.

    Every primitive a cache applies (map, unmap, a copy that overwrites bytes) records its
    inverse right after it succeeds, so undoing in reverse order walks memory back through the
    exact states it went through; the swap space is restored from the copy taken when the plan
    was bound.
    """

    def __init__(self, swapped_before: dict) -> None:
        self.swapped_before = swapped_before
        self.op_index: Optional[int] = None    # index in the plan of the op being applied
        self._undo: list = []

    def add(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def __len__(self) -> int:
        return len(self._undo)

    def undo(self) -> Optional[BaseException]:
        """Run every undo action, newest first; returns the first error an action raised (the
        remaining actions still run), None when memory is fully back."""
        first = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as error:  # keep undoing what can be undone
                first = first or error
        return first


def run_plan(manager, cache: "KVCache", mutate: Callable[[], T]) -> T:
    """Run "mutate the manager, take its ops, execute them" as one unit: all of it or none.

    ``mutate()`` makes manager calls (allocate, append, fork, free, swap_out, swap_in, ...; a
    scheduler's ``schedule()`` if the caller can undo the scheduler's own queues) and returns
    anything. Contract:
    - on success the ops are fully applied (with a background mapper this WAITS for the whole
      plan, giving up the mapper's overlap for this step) and the manager's changes committed;
      returns ``mutate()``'s result;
    - if ``mutate`` raises, or ``cache.execute`` fails part-way (a driver call, an OOM), the
      cache has undone what it applied, the manager is rolled back to its state before
      ``mutate`` (tables, counters, pending ops), and the error propagates: a scheduler error
      from ``mutate`` as is, a failed plan as ``PlanExecutionError`` (``MapperPlanError`` with
      a background mapper). No page is leaked, no sequence lost, every sequence's cached
      contents are as before, and the same step may simply be retried;
    - the manager must have no open transaction (they do not nest) and no ops pending from
      before (they would be executed, or restored as pending on failure);
    - if undoing memory itself failed (``PlanExecutionError.rolled_back`` is False) the cache
      refuses further use; close it. State OUTSIDE the manager and cache (request queues,
      sampled tokens) is the caller's to undo.
    """
    manager.begin()
    try:
        result = mutate()
        cache.execute(manager.take_ops())
        cache.wait_for_plan()
    except BaseException:
        manager.rollback()
        raise
    manager.commit()
    return result


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
        self._broken: Optional[str] = None            # why the cache is unusable (failed undo)

    # -- plans --
    @abstractmethod
    def execute(self, ops: Sequence) -> None:
        """Carry out the manager's memory ops, in order. All or nothing: if an op fails, what
        the plan had applied is undone and PlanExecutionError is raised (see ``run_plan``)."""

    def wait_for_plan(self) -> None:
        """Block until the last executed plan is fully applied; raise its error if it failed.
        (Plans run inline unless a cache has a background mapper.)"""

    def _fail_plan(self, journal: PlanJournal, error: BaseException) -> PlanExecutionError:
        """Undo a partly applied plan and build the error to raise (chained by the caller)."""
        undo_error = journal.undo()
        self._swapped = journal.swapped_before
        where = f"op {journal.op_index}" if journal.op_index is not None else "binding"
        if undo_error is not None:
            self._broken = f"undoing a failed plan failed: {undo_error}"
            return PlanExecutionError(
                f"plan failed at {where} ({type(error).__name__}: {error}) and could not be "
                f"undone ({type(undo_error).__name__}: {undo_error}); close this cache",
                op_index=journal.op_index, rolled_back=False)
        return PlanExecutionError(f"plan failed at {where} and was undone: "
                                  f"{type(error).__name__}: {error}",
                                  op_index=journal.op_index, rolled_back=True)

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
        All or nothing: on an error (a bad op, no memory for a buffer) the swap space is as
        before. ``self._swapped_before`` keeps the swap space as it was, for undoing the plan.
        """
        before = dict(self._swapped)
        try:
            bound = self._bind_swaps_in_order(ops)
        except BaseException:
            self._swapped = before
            raise
        # A swapped sequence that the manager freed (dropped its host copy) emits no op: drop
        # its buffer once the plan is bound, or host memory would leak one buffer per such
        # sequence. (The manager's tables already include this plan.)
        for seq_id in [s for s in self._swapped if not self.manager.is_swapped(s)]:
            del self._swapped[seq_id]
        self._swapped_before = before
        return bound

    def _bind_swaps_in_order(self, ops: Sequence) -> list:
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

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CacheStateError(f"cache unusable: {self._broken}")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise CacheStateError(f"layer {layer} outside 0..{self.config.num_layers - 1}")
        if self._step is None:
            raise CacheStateError("no step begun: call begin_step(...) first")

    def check_integrity(self) -> None:
        """Assert that memory matches the manager's tables (AssertionError on a bug). Layouts
        add their own checks; this one checks the manager and the swap space."""
        self.manager.check_integrity()
        for seq_id, buffer in self._swapped.items():
            assert self.manager.is_swapped(seq_id), f"swap space holds unknown sequence {seq_id}"
            assert buffer.shape[2] == self.manager.num_tokens(seq_id), f"swap size of {seq_id}"

    def close(self) -> None:
        """Release memory; the cache cannot be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
