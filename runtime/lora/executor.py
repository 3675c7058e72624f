"""The executor side of LoRA adapters on one model (the engine's, or a tensor-parallel rank's
shard): a ``LoadAdapter`` op's weights (a shard's slice of them: B's rows of its column-parallel
projections, A's columns of its row-parallel ones) are written into the pool pages the cache
mapped for it, and each step's rows get their adapters' weights as zero-copy views of those
pages.

    executor = AdapterExecutor(model, host_copy)   # host_copy(digest) -> LoraAdapter or None
    executor.apply(plan.ops, cache)                # after the cache executed the ops
    with executor.batch(plan.seqs, cache):         # around the model's forward
        model(...)

Which adapters exist, by name, is the engine's (runtime/engine/adapters.py); a follower rank
holds the host copies rank 0 sends with the plans that load them (runtime/distributed/worker.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Dict, Optional

from vmemkv.scheduler.plan import EvictAdapter, LoadAdapter

from .errors import LoraBatchError
from .layers import LoraBatch, attach_lora


class AdapterExecutor:
    """Writes loaded adapters into their pool pages and runs each step's rows with theirs."""

    def __init__(self, model, host_copy: Callable[[str], Optional[object]]) -> None:
        self._model = model
        self._host_copy = host_copy      # digest -> LoraAdapter (its host image and layout)
        self._slots = None               # runtime.lora.LoraSlots, attached on first use
        self._cuts: Dict[str, tuple] = {}    # module -> (B's rows, A's columns) a shard keeps
        self._sliced: Dict[str, object] = {}  # digest -> this model's slice, once packed: its
                                              # layout (no host image), or the host copy itself
        self._views: Dict[str, tuple] = {}   # digest -> (buffer address, AdapterWeights)
        self.loads = 0                   # LoadAdapter ops executed (weights written)

    def attach(self) -> None:
        """Hook the model's projections (idempotent; without a batch they change nothing)."""
        if self._slots is None:
            self._slots = attach_lora(self._model)
            self._cuts = {name: (getattr(module, "lora_out_rows", None),
                                 getattr(module, "lora_in_cols", None))
                          for name, module in self._slots.hooked.items()}

    def held(self, adapter):
        """``adapter`` as this model holds it in its pool: whole on one process, a
        tensor-parallel shard's slice of each module (``LoraAdapter.sliced``)."""
        self.attach()
        return adapter.sliced(self._cuts)

    def apply(self, ops, cache) -> None:
        """After a plan's ops ran: write each loaded adapter's weights (this model's slice)
        into its pool pages."""
        for op in ops:
            if isinstance(op, LoadAdapter):
                host = self._host_copy(op.adapter_id)
                if host is None:   # a bug: the scheduler pinned an adapter nobody holds
                    raise LoraBatchError(f"adapter {op.adapter_id[:12]} loaded with no weights")
                mine = self.held(host)
                mine.pack_into(cache.adapter_buffer(op.adapter_id))
                # a slice's host image is not needed once packed: keep its layout only
                self._sliced[op.adapter_id] = mine if mine is host else mine.without_image()
                self._views.pop(op.adapter_id, None)
                self.loads += 1
            elif isinstance(op, EvictAdapter):
                self._views.pop(op.adapter_id, None)
                self._sliced.pop(op.adapter_id, None)

    def _packed(self, digest: str):
        """The adapter's layout as this model holds it (loaded by ``apply``)."""
        known = self._sliced.get(digest)
        if known is None:
            known = self._sliced[digest] = self.held(self._host_copy(digest)).without_image()
        return known

    def batch(self, seqs, cache):
        """A context running the step's rows with their adapters (nullcontext when none)."""
        if not any(s.adapter_id for s in seqs):
            return nullcontext()
        self.attach()
        segments, row = [], 0
        for s in seqs:
            end = row + s.num_new_tokens
            if s.adapter_id is not None:
                segments.append((row, end, self._weights(s.adapter_id, cache)))
            row = end
        return self._slots.batch(LoraBatch(segments))

    def _weights(self, digest: str, cache):
        buffer = cache.adapter_buffer(digest)
        known = self._views.get(digest)
        if known is None or known[0] != buffer.data_ptr():
            known = self._views[digest] = (buffer.data_ptr(), self._packed(digest).views(buffer))
        return known[1]
