"""The interface both cache kinds share, and the per-step batch they index with. A cache is a
pure executor, built from a CacheConfig and the manager's layout, that knows only what plans
told it (a step's hops: docs/ARCHITECTURE.md). ``begin_step`` checks every write against that
replica (CacheStateError) and builds every layer's view once: one host sync per step.
"""
from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vmemkv.runtime.attention.checks import packed_starts
from vmemkv.runtime.attention.views import BatchLens, LayerView
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.plan import DropSwapped, DropTable, SwapIn, SwapOut
from vmemkv.vmem.checks import as_int, check_index

from ..config import CacheConfig
from ..errors import CacheStateError, PlanExecutionError
from ..kv_dtype import ScaleTable
from ..memory import PromisesMemory, check_fits_device
from .journal import PlanJournal


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
        return cls(seq_ids, BatchLens(context, query, packed_starts(query)),
                   torch.tensor(positions, dtype=torch.int64, device=device),
                   torch.tensor(owners, dtype=torch.int64, device=device),
                   torch.tensor(context, dtype=torch.int32, device=device),
                   torch.tensor(query, dtype=torch.int32, device=device))


class KVCache(ABC):
    """A KV cache that executes plans on real memory, knowing only what plans told it.

    Guarantees: ``execute(ops)`` is all or nothing; ``apply_tables`` updates the cache's replica
    of where each sequence lives; ``write`` only stores into memory the plans mapped for the
    step's sequences (it checks, and raises CacheStateError rather than fault); ``layer_view``
    hands attention exactly the live tokens. A plan (``execute`` with ops, ``apply_tables`` with
    edits) ends the step: a stale write went to blocks or slots the plan gave to another sequence.
    """

    kind: CacheKind           # what memory the cache is made of (a str enum, equal to its name)
    config: CacheConfig
    refuses_unstorable = True   # check_storable on write (False on TP ranks: worker.py)

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._step: StepBatch | None = None
        self._views: list = []                         # per layer, built once per step
        self._placements: dict = {}                    # seq_id -> slot (vmem) / block table (paged)
        self._swapped: dict[int, torch.Tensor] = {}   # seq_id -> [layers, 2, tokens, kv_heads, head_dim]
        self._swap_owner: Optional[weakref.ref] = None  # whose promise counts the swap space
        self._broken: Optional[str] = None            # why the cache is unusable (failed undo)
        enc = config.kv_encoding                      # 8-bit: scales beside the cache
        self.kv_scales = ScaleTable(enc, config.num_layers, config.num_kv_heads,
                                    config.torch_device, config.kv_scales) if enc.scaled else None

    # -- plans --
    @abstractmethod
    def execute(self, ops: Sequence) -> None:
        """Carry out a plan's memory ops, in order. All or nothing: if an op fails, what the
        plan had applied is undone and PlanExecutionError is raised."""

    @property
    def mapping_s(self) -> float:
        """Seconds spent applying vmem page ops so far, inline or on a mapper thread (0 for a
        cache without page mapping)."""
        return 0.0

    @property
    def mapping_stall_s(self) -> float:
        """Of that, the seconds the step thread was blocked: applying ops inline, or waiting
        for the mapper thread. ``mapping_s - mapping_stall_s`` is the overlap a mapper won."""
        return 0.0

    def wait_for_plan(self) -> None:
        """Block until the last executed plan is fully applied; raise its error if it failed.
        (Plans run inline unless a cache has a background mapper.)"""

    def apply_tables(self, edits: Sequence) -> None:
        """Apply a plan's table edits (SetSlot / EditBlocks / DropTable) to the replica, in
        order. All or nothing: a bad edit raises CacheStateError and changes nothing."""
        self._check_usable()
        if not edits:
            return
        replica = dict(self._placements)
        for index, edit in enumerate(edits):
            if isinstance(edit, DropTable):
                replica.pop(edit.seq_id, None)
            else:
                replica[edit.seq_id] = self._placed(edit, replica.get(edit.seq_id), index)
        self._placements = replica
        self._step = None   # the step's writes and views were for the placements before

    @abstractmethod
    def _placed(self, edit, old, index: int):
        """The placement after ``edit`` (the cache kind's own edit type), or CacheStateError."""

    def placement(self, seq_id: int):
        """Where the plans placed ``seq_id`` (vmem: its slot; paged: its block table)."""
        try:
            return self._placements[seq_id]
        except KeyError:
            raise CacheStateError(f"sequence {seq_id} has no placement: no plan placed it "
                                  f"(or it was dropped)") from None

    @property
    def placed_seq_ids(self) -> list[int]:
        return list(self._placements)

    def _fail_plan(self, journal: PlanJournal, error: BaseException) -> PlanExecutionError:
        """Undo a partly applied plan and build the error to raise (chained by the caller)."""
        undo_error = self._undo_plan(journal)
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

    def _undo_plan(self, journal: PlanJournal) -> Optional[BaseException]:
        """Memory, swap space and replica as before the plan; idempotent (an interrupt may
        reach this twice). Returns the first error an undo action raised."""
        undo_error = journal.undo()
        self._swapped = journal.swapped_before
        while journal.replica_undo:
            journal.replica_undo.pop()()
        return undo_error

    # -- steps --
    def begin_step(self, seqs: Sequence[tuple[int, int, int]]) -> StepBatch:
        """Index this step's sequences; every new token must lie in memory the plans mapped
        for it. Builds the step's write indices and every layer's view (one host sync)."""
        self._check_usable()
        for seq_id, computed, new in seqs:
            gap = self._write_gap(seq_id, computed, computed + new)
            if gap is not None:
                raise CacheStateError(
                    f"sequence {seq_id}: writing tokens up to {computed + new} but {gap}; grow "
                    f"it with the manager (allocate/append) and execute that plan first")
        step = StepBatch.build(seqs, self.config.torch_device)
        views = self._build_step_views(step)   # raises before changing anything
        self._step, self._views = step, views
        return step

    @abstractmethod
    def _held_tokens(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` that the replica says are backed by memory."""

    def _write_gap(self, seq_id: int, start: int, end: int) -> Optional[str]:
        """None when tokens [start, end) of ``seq_id`` lie in memory the replica says is
        backed, else what is missing (a cache may answer in O(tokens asked) where
        ``_held_tokens`` walks them all)."""
        held = self._held_tokens(seq_id)
        return None if end <= held else f"the plans gave it memory for {held}"

    @abstractmethod
    def _build_step_views(self, step: StepBatch) -> list:
        """The ONE per-step builder: write indices and a view per layer, sharing metadata.
        Every check runs before the cache's step state is replaced."""

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's new keys and values ``[new_tokens, kv_heads, head_dim]`` of a layer,
        encoded as ``config.kv_cache_dtype`` (``encode``)."""

    def _encode_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """``encode`` for ``write``, after CacheStateError unless ``k``, ``v`` are the step's
        floating ``[new_tokens, kv_heads, head_dim]`` on its device (nothing fixed or stored)."""
        want = (self._step.lens.total_query_tokens, self.config.num_kv_heads, self.config.head_dim)
        device = self._step.positions.device
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want \
                    or not x.dtype.is_floating_point or x.device != device:
                got = (tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) \
                    else type(x).__name__
                raise CacheStateError(
                    f"write: {name} must be a floating tensor [new_tokens, kv_heads, head_dim] = "
                    f"{list(want)} on {device} for this step; got {got}")
        return self.encode(layer, k, v)

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """``k``, ``v`` ``[tokens, kv_heads, head_dim]`` as this cache stores them: cast to the
        storage dtype, or (8-bit) quantized with the layer's scales, which the layer's first
        write fixes when none were given (``runtime.kv_dtype``)."""
        if self.kv_scales is None:
            if self.refuses_unstorable:   # fp16 of a wider model: past 65504 stored inf
                self.config.check_storable(k, v)
            return k, v      # the caller casts to the storage dtype
        return self.kv_scales.encode(layer, k, v)

    def scales_of(self, layer: int) -> dict:
        """The keyword arguments a layer view takes for the scales: ``k_scale``/``v_scale``
        fp32 ``[kv_heads]`` rows of ``kv_scales`` (filled in place), or none (unscaled)."""
        if self.kv_scales is None:
            return {}
        return {"k_scale": self.kv_scales.k[layer], "v_scale": self.kv_scales.v[layer]}

    @abstractmethod
    def layer_view(self, layer: int) -> LayerView:
        """What an attention backend needs for ``layer`` in the current step."""

    @abstractmethod
    def read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a sequence's first ``num_tokens`` K and V of ``layer`` (for checks), as
        stored (the storage dtype; 8-bit: unscaled, see ``kv_scales``)."""

    def _check_read(self, seq_id: int, layer: int, num_tokens: int) -> tuple[int, int]:
        """``layer`` and ``num_tokens`` (in [0, tokens held]) as ints, else CacheStateError (a
        count -n sliced ``[:-n]``, past the sequence into unmapped memory: SIGSEGV on the host)."""
        layer = check_index(layer, self.config.num_layers, "layer", "the model's", CacheStateError)
        held, tokens = self._held_tokens(seq_id), as_int(num_tokens, "num_tokens", CacheStateError)
        if not 0 <= tokens <= held:
            raise CacheStateError(f"sequence {seq_id} holds {held} tokens, asked to read "
                                  f"{tokens} (an int in [0, {held}])")
        return layer, tokens

    # -- swap space (host memory) --
    def swap_promised_by(self, owner: PromisesMemory) -> None:
        """``owner`` (the engine, held weakly) counts this swap space's unfilled bytes in its
        promise (runtime/memory.py): a swap-out fills what its owner promised (its promises
        were checked beside each other when made), so its check leaves out only the other
        owners' promises."""
        self._swap_owner = weakref.ref(owner)

    @property
    def swapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._swapped.values())

    def swap_buffer(self, seq_id: int) -> torch.Tensor:
        """The host copy of swapped-out ``seq_id``: ``[layers, 2, tokens, kv_heads, head_dim]``,
        complete when returned (it waits for the queued device-to-host copies)."""
        try:
            buffer = self._swapped[seq_id]
        except KeyError:
            raise CacheStateError(f"sequence {seq_id} has no swapped-out data") from None
        self._wait_for_swaps()
        return buffer

    @property
    def swaps_are_async(self) -> bool:
        """True on CUDA: swap copies to and from pinned host buffers are queued on the current
        stream (non_blocking) instead of draining it. They stay ordered with every kernel and
        copy on that stream, so a swap-in after a swap-out reads the finished bytes, and
        torch's pinned allocator keeps a dropped buffer alive until its copy has run; only a
        host read (``swap_buffer``) waits."""
        return self.config.torch_device.type == "cuda"

    def _swap_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One swap copy (either direction), queued in plan order; see ``swaps_are_async``."""
        dst.copy_(src, non_blocking=self.swaps_are_async)

    def _wait_for_swaps(self) -> None:
        if self.swaps_are_async:
            torch.cuda.current_stream(self.config.torch_device).synchronize()

    def swapped_tokens(self) -> dict[int, int]:
        """{seq_id: tokens} of every host copy the swap space holds."""
        return {seq_id: buffer.shape[2] for seq_id, buffer in self._swapped.items()}

    def _bind_swaps(self, ops: Sequence) -> list[tuple[object, Optional[torch.Tensor]]]:
        """Pair every op with its host buffer, updating the swap space in plan order.

        SwapOut gets a fresh buffer (registered as the sequence's swapped copy); SwapIn gets
        the sequence's current copy (and drops it from the swap space); DropSwapped drops it.
        Binding up front keeps a plan that swaps a sequence in and out again correct when it
        is applied layer by layer. All or nothing: on an error (a bad op, no memory for a
        buffer) the swap space is as before. ``self._swapped_before`` keeps the swap space as
        it was, for undoing the plan.

        Each SwapOut's buffer (with the plan's earlier ones) is checked against the host's
        available memory, less what the other engines promised (``swap_promised_by``), before
        it is allocated: one the host cannot provide now (memory taken since construction
        checked ``swap_bytes``) is refused as PlanExecutionError
        naming that op, its cause a CacheTooLargeError giving both sizes; the engine rolls the
        step back, nothing allocated, and retries it (the request fails after
        ``max_plan_retries`` refusals in a row).
        """
        before = dict(self._swapped)
        planned_bytes = 0   # this plan's swap-out buffers so far: not written, not yet counted
        try:
            bound = []
            for index, op in enumerate(ops):
                if isinstance(op, SwapOut):
                    planned_bytes += self._check_swap_buffer(op, index, planned_bytes)
                bound.append((op, self._bind_one(op)))
        except BaseException:
            self._swapped = before
            raise
        self._swapped_before = before
        return [pair for pair in bound if not isinstance(pair[0], DropSwapped)]

    def _swap_buffer_shape(self, num_tokens: int) -> tuple:
        c = self.config
        return (c.num_layers, 2, num_tokens, c.num_kv_heads, c.head_dim)

    def _check_swap_buffer(self, op: SwapOut, index: int, planned_bytes: int) -> int:
        """The bytes of ``op``'s host buffer, after checking them (beside ``planned_bytes``,
        the plan's earlier buffers) against the host's memory; PlanExecutionError if not."""
        num_bytes = (math.prod(self._swap_buffer_shape(op.num_tokens))
                     * self.config.storage_dtype.itemsize)
        try:
            check_fits_device(f"swapping out sequence {op.seq_id} ({op.num_tokens} tokens, "
                              f"{num_bytes} bytes, beside {planned_bytes} bytes of this plan's "
                              f"other swap-outs)", num_bytes + planned_bytes, torch.device("cpu"),
                              remedy="the host has less free memory than when swap_bytes was "
                                     "checked; nothing was allocated",
                              promiser=self._swap_owner() if self._swap_owner else None)
        except MemoryError as error:
            raise PlanExecutionError(f"plan refused at op {index} ({type(op).__name__}): "
                                     f"{error}", op_index=index) from error
        return num_bytes

    def _bind_one(self, op) -> Optional[torch.Tensor]:
        if isinstance(op, SwapOut):
            c = self.config
            buffer = torch.empty(self._swap_buffer_shape(op.num_tokens),
                                 dtype=c.storage_dtype, pin_memory=c.torch_device.type == "cuda")
            self._swapped[op.seq_id] = buffer
            return buffer
        if isinstance(op, (SwapIn, DropSwapped)):
            buffer = self._swapped.pop(op.seq_id, None)
            if buffer is None:
                raise CacheStateError(f"sequence {op.seq_id} has no swapped-out data to "
                                      f"{'swap in' if isinstance(op, SwapIn) else 'drop'}")
            if isinstance(op, SwapIn) and buffer.shape[2] != op.num_tokens:
                raise CacheStateError(f"sequence {op.seq_id}: swapping in {op.num_tokens} "
                                      f"tokens but {buffer.shape[2]} were swapped out")
            return buffer
        return None

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CacheStateError(f"cache unusable: {self._broken}")

    def _check_layer(self, layer: int) -> None:
        check_index(layer, self.config.num_layers, "layer", "the model's", CacheStateError)
        if self._step is None:
            raise CacheStateError("no step begun since the last plan (execute, apply_tables): "
                                  "call begin_step(...) first")

    # -- LoRA adapters (cache/adapters.py) --
    def resident_adapters(self) -> dict:
        """{adapter_id: (pool pages or blocks, num_bytes)} the plans left resident."""
        return {}

    def adapter_buffer(self, adapter_id: str) -> torch.Tensor:
        """A resident adapter's memory: a 1-D uint8 tensor of its ``num_bytes``, zero-copy
        (the caller writes the weights in after the plan that loaded it ran)."""
        raise CacheStateError(f"{type(self).__name__} holds no adapter {str(adapter_id)[:12]}")

    def check_integrity(self) -> None:
        """Assert the cache is consistent with itself (AssertionError on a bug): swap buffers
        are well formed; kinds add their memory checks. Whether it matches a manager's tables
        is ``vmemkv.runtime.kv.check_matches``'s job."""
        c = self.config
        for seq_id, buffer in self._swapped.items():
            assert buffer.shape[:2] == (c.num_layers, 2), f"swap buffer shape of {seq_id}"

    def close(self) -> None:
        """Release memory; the cache cannot be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
