"""What every manager shares: sequence lookup, the pending op list, swap-space accounting.

A concrete manager supplies four hooks over device memory:
  ``_release(seq)``          give back everything a resident sequence holds (as free does);
  ``_fresh_units(n)``        how many free units placing n tokens privately would take, or None
                             when it can never be placed now (e.g. no free slot);
  ``_available_units()``     units a new allocation may take (free + reclaimable);
  ``_place_private(id, seq)`` hold private (unshared) memory for ``seq.num_tokens`` tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from ..errors import (ConfigError, SchedulerError, DuplicateSequenceError, RequestTooLargeError,
                      SwapSpaceExhaustedError, UnknownSequenceError)
from ..presets import ModelSpec
from .base import DropSwapped, MemoryManager, SwapIn, SwapOut
from .prefix import SeqState


class TransactionStateError(SchedulerError, RuntimeError):
    """``begin`` inside an open transaction, or ``commit``/``rollback`` without one."""


_IMMUTABLE = {int, float, str, bool, type(None), tuple, frozenset, bytes}


def _immutable(kind: type) -> bool:
    """Scalars, tuples and frozen dataclasses (the memory ops) are shared, never copied."""
    if kind in _IMMUTABLE:
        return True
    params = getattr(kind, "__dataclass_params__", None)
    if params is not None and params.frozen:
        _IMMUTABLE.add(kind)
        return True
    return False


def _clone(value):
    """A copy of a manager field deep enough that later mutations of the manager cannot reach
    it: containers are copied (at C speed when their elements are immutable), SeqState and
    helper objects (PrefixIndex, FreeSlots) field by field. Manager containers are homogeneous,
    so the first element says what the rest are."""
    kind = type(value)
    if _immutable(kind):
        return value
    if kind is list:
        if not value or _immutable(type(value[0])):
            return value.copy()
        first = type(value[0])
        if first is set:                      # e.g. group -> {(slot, page_index)}
            return list(map(set.copy, value))
        if first is dict:                     # e.g. slot -> {page_index: group}
            sample = next((d for d in value if d), None)
            if sample is None or _immutable(type(next(iter(sample.values())))):
                return list(map(dict.copy, value))
        return [_clone(x) for x in value]
    if kind is dict or kind is OrderedDict:
        if value and not _immutable(type(next(iter(value.values())))):
            return kind((k, _clone(v)) for k, v in value.items())
        return value.copy()
    if kind is set:
        return value.copy()      # sets hold ints or tuples of ints
    if kind is SeqState:
        # ids and hashes only ever grow in place (extend/append) or are rebound: share them,
        # and begin() records their lengths so rollback() can cut them back
        c = SeqState(value.num_tokens, value.ids, value.namespace)
        c.units, c.hashes, c.reserved, c.slot = value.units.copy(), value.hashes, value.reserved, value.slot
        return c
    clone = object.__new__(kind)
    clone.__dict__.update({k: _clone(v) for k, v in value.__dict__.items()})
    return clone


def check_int(field: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in [low, high], else ConfigError naming field, value and range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{field} must be an int {allowed}, got {value!r}")
    return value


class ManagerCore(MemoryManager):
    """Sequence table, op list, swap space and the checks every manager makes the same way."""

    def __init__(self, model: ModelSpec, max_seq_len_tokens: int, swap_bytes: int) -> None:
        self.model = model
        self.bytes_per_token = model.bytes_per_token
        self.max_seq_len = check_int("max_seq_len_tokens", max_seq_len_tokens, 1)
        self.swap_bytes = check_int("swap_bytes", swap_bytes, 0)
        self._seqs: dict = {}           # seq_id -> SeqState, resident on the device
        self._swapped: dict = {}        # seq_id -> SeqState, in host swap space
        self._swap_used_tokens = 0
        self._ops: list = []
        self.prefix_queries = 0         # tokens offered for prefix matching (allocate)
        self.prefix_hits = 0            # of those, tokens found cached
        self._txn = None                # snapshot taken by begin(), None outside a transaction

    # Indexes a manager can recompute from its other fields: not copied by begin(), rebuilt by
    # rollback() (cheaper per step when rollbacks are rare).
    _TXN_DERIVED: tuple = ()

    def _rebuild_derived(self) -> None:
        """Recompute the fields named in ``_TXN_DERIVED`` after a rollback."""

    # -- transactions (additive: nothing on the hot path; cost is paid only by begin) --
    def begin(self) -> None:
        """Open a transaction: every later change (tables, counters, pending ops) can be undone
        with ``rollback`` until ``commit``. Costs one copy of the manager's mutable state, O(units
        + sequences) at C speed; calls between begin and commit run exactly as without it.
        Raises TransactionStateError if a transaction is already open (they do not nest)."""
        if self._txn is not None:
            raise TransactionStateError("begin() inside an open transaction; commit or roll back first")
        skip = ("model", "_txn") + self._TXN_DERIVED
        self._txn = {k: _clone(v) for k, v in self.__dict__.items() if k not in skip}
        self._txn["_txn_lengths"] = [(lst, len(lst)) for seqs in (self._seqs, self._swapped)
                                     for seq in seqs.values()
                                     for lst in (seq.ids, seq.hashes) if lst is not None]

    def commit(self) -> None:
        """Keep every change since ``begin`` and close the transaction."""
        if self._txn is None:
            raise TransactionStateError("commit() without begin()")
        self._txn = None

    def rollback(self) -> None:
        """Restore the state (and pending op list) exactly as it was at ``begin``; close the
        transaction. Objects the manager held are replaced by their snapshots."""
        if self._txn is None:
            raise TransactionStateError("rollback() without begin()")
        state, self._txn = self._txn, None
        for lst, length in state.pop("_txn_lengths"):
            del lst[length:]
        self.__dict__.update(state)
        self._rebuild_derived()

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    # -- lookups and argument checks --
    def _seq(self, seq_id: int) -> SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if seq_id in self._swapped:
                raise UnknownSequenceError(f"sequence {seq_id} is swapped out, not resident")
            raise UnknownSequenceError(f"unknown sequence {seq_id} (never allocated, or freed)")
        return seq

    def _check_new(self, seq_id: int) -> None:
        if seq_id in self._seqs or seq_id in self._swapped:
            raise DuplicateSequenceError(f"sequence {seq_id} is already held")

    def _check_length(self, num_tokens: int, what: str = "num_tokens") -> None:
        check_int(what, num_tokens, 0)
        if num_tokens > self.max_sequence_tokens:
            raise RequestTooLargeError(
                f"{what}={num_tokens} exceeds the longest sequence this cache can hold, "
                f"{self.max_sequence_tokens} tokens (max_seq_len {self.max_seq_len}, "
                f"cache {self.stats().total_tokens})")

    @staticmethod
    def _new_seq(num_tokens: int, token_ids: Optional[Sequence[int]],
                 namespace: Optional[str]) -> SeqState:
        return SeqState(num_tokens, None if token_ids is None else list(token_ids), namespace)

    @staticmethod
    def _check_append_ids(num_tokens: int, token_ids: Optional[Sequence[int]]) -> None:
        check_int("num_tokens", num_tokens, 0)
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ConfigError(f"token_ids has {len(token_ids)} ids for num_tokens={num_tokens}")

    # -- ops --
    def take_ops(self) -> list:
        ops, self._ops = self._ops, []
        return ops

    # -- release --
    def free(self, seq_id: int, computed_tokens: Optional[int] = None) -> None:
        """Release a resident sequence, or drop a swapped one's host copy. ``computed_tokens``
        (when the caller knows fewer tokens were computed than held, e.g. a prefill preempted
        part-way) withdraws the sequence's uncomputed units from prefix sharing, so no later
        request can hit memory whose K/V was never written."""
        if seq_id in self._swapped:
            self._swap_used_tokens -= self._swapped.pop(seq_id).num_tokens
            self._ops.append(DropSwapped(seq_id))
            return
        seq = self._seq(seq_id)
        if computed_tokens is not None and computed_tokens < seq.num_tokens:
            self._forget_uncomputed(seq, computed_tokens)
        self._release(seq)
        del self._seqs[seq_id]

    def num_tokens(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id) or self._swapped.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id} (never allocated, or freed)")
        return seq.num_tokens

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._swapped

    # -- swap --
    @property
    def swap_free_bytes(self) -> int:
        return self.swap_bytes - self._swap_used_tokens * self.bytes_per_token

    def can_swap_out(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.num_tokens * self.bytes_per_token <= self.swap_free_bytes

    def swap_out(self, seq_id: int) -> int:
        seq = self._seq(seq_id)
        need = seq.num_tokens * self.bytes_per_token
        if need > self.swap_free_bytes:
            raise SwapSpaceExhaustedError(
                f"swapping out sequence {seq_id} needs {need} bytes of swap space, "
                f"{self.swap_free_bytes} of {self.swap_bytes} free")
        self._ops.append(SwapOut(seq_id, seq.num_tokens, **self._swap_location(seq)))
        self._release(seq)
        del self._seqs[seq_id]
        seq.units = []
        self._swapped[seq_id] = seq
        self._swap_used_tokens += seq.num_tokens
        return seq.num_tokens

    def can_swap_in(self, seq_id: int) -> bool:
        seq = self._swapped.get(seq_id)
        if seq is None:
            return False
        need = self._fresh_units(seq)
        return need is not None and need <= self._available_units()

    def swap_in(self, seq_id: int) -> None:
        seq = self._swapped.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id} is not swapped out")
        if not self.can_swap_in(seq_id):
            self._raise_no_room(f"swapping in sequence {seq_id} ({seq.num_tokens} tokens)")
        del self._swapped[seq_id]
        self._swap_used_tokens -= seq.num_tokens
        self._place_private(seq_id, seq)
        self._seqs[seq_id] = seq
        self._ops.append(SwapIn(seq_id, seq.num_tokens, **self._swap_location(seq)))

    def _swap_integrity(self) -> None:
        assert not (self._seqs.keys() & self._swapped.keys())
        assert self._swap_used_tokens == sum(s.num_tokens for s in self._swapped.values())
        assert 0 <= self._swap_used_tokens * self.bytes_per_token <= self.swap_bytes

    # -- hooks --
    def _forget_uncomputed(self, seq: SeqState, computed_tokens: int) -> None:
        """Withdraw units past ``computed_tokens`` from prefix sharing (managers that share)."""

    def _swap_location(self, seq: SeqState) -> dict:
        """Where a sequence's tokens are, for SwapOut/SwapIn ops (vmem: slot; paged: blocks)."""
        return {}

    def _release(self, seq: SeqState) -> None:
        raise NotImplementedError

    def _fresh_units(self, seq: SeqState) -> Optional[int]:
        raise NotImplementedError

    def _available_units(self) -> int:
        raise NotImplementedError

    def _place_private(self, seq_id: int, seq: SeqState) -> None:
        raise NotImplementedError

    def _raise_no_room(self, what: str) -> None:
        raise NotImplementedError

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence this manager could ever hold (max length, capped by the cache);
        the scheduler rejects longer requests at submission."""
        raise NotImplementedError
