"""What every manager shares: sequence lookup, the pending op list, swap-space accounting and
transactions (an undo journal, see ``begin`` and journal.py). A concrete manager supplies the
abstract hooks at the end over its device memory (release, place, count free units).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Optional, Sequence

from ..errors import (ConfigError, DuplicateSequenceError, RequestTooLargeError,
                      SwapSpaceExhaustedError, TransactionStateError, UnknownSequenceError)
from ..presets import ModelSpec
from .base import DropSwapped, MemoryManager, SwapIn, SwapOut
from .journal import MISSING, JDict, TxnCell, journaled, put_back
from .prefix import HeldSeq, token_bytes

__all__ = ["ManagerCore", "TransactionStateError", "check_int"]


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
        self._cell = cell = TxnCell()   # the open transaction (journal.py), shared by helpers
        self._seqs: dict = {}           # seq_id -> HeldSeq, resident (see _put_seq/_drop_seq)
        self._swapped = JDict(cell)     # seq_id -> HeldSeq, in host swap space
        self._swap_used_tokens = 0
        self._ops: list = []
        self.prefix_queries = 0         # tokens offered for prefix matching (allocate)
        self.prefix_hits = 0            # of those, tokens found cached

    # How rollback covers each field; every field is in one group (a test checks it,
    # ``journal_gaps``). FIXED: set at construction.
    # SAVED: values only ever rebound, never changed in place, saved by name at begin (never
    # through vars(): a materialised instance dict slows every attribute read on 3.11).
    # COPIED: copied at begin (the pending ops, few). LOGGED: plain containers the manager
    # logs itself at each write (``_touch``, ``_put_seq``), kept plain for the hot paths.
    # JOURNALED: containers and helpers that log their own changes (journal.py).
    _FIXED_FIELDS = frozenset({"model", "bytes_per_token", "max_seq_len", "swap_bytes", "_cell"})
    _SAVED_FIELDS: tuple = ("_swap_used_tokens", "prefix_queries", "prefix_hits")
    _COPIED_FIELDS: tuple = ("_ops",)
    _LOGGED_FIELDS = frozenset({"_seqs"})
    _JOURNALED_FIELDS = frozenset({"_swapped"})

    # -- transactions: an undo journal opened by begin, replayed by rollback --
    def begin(self) -> None:
        """Open a transaction: every later change (tables, counters, sequence records, pending
        ops) is undone by ``rollback`` until ``commit``. O(1): the fields are saved by name and
        each later change logs its inverse (journal.py), so rollback costs O(changes since
        begin) and commit O(1). Raises TransactionStateError if a transaction is already open
        (they do not nest)."""
        if self._cell.active:
            raise TransactionStateError("begin() inside an open transaction; commit or roll back first")
        fields = {name: getattr(self, name) for name in self._SAVED_FIELDS}
        for name in self._COPIED_FIELDS:
            fields[name] = list(getattr(self, name))
        self._cell.open(fields)

    def commit(self) -> None:
        """Keep every change since ``begin`` and close the transaction."""
        if not self._cell.active:
            raise TransactionStateError("commit() without begin()")
        self._cell.commit()

    def rollback(self) -> None:
        """Restore every field, sequence record and the pending op list exactly as they were at
        ``begin``; close the transaction."""
        if not self._cell.active:
            raise TransactionStateError("rollback() without begin()")
        for name, value in self._cell.rollback(*self._unit_arrays()).items():
            setattr(self, name, value)

    @property
    def in_transaction(self) -> bool:
        return self._cell.active

    def _unit_arrays(self) -> tuple:
        """The plain per-unit lists written under ``_touch`` (units.py); none here."""
        return [], []

    def journal_gaps(self) -> list:
        """Fields a rollback would not restore (must be empty; a test checks every manager)."""
        plain = (self._FIXED_FIELDS | set(self._SAVED_FIELDS) | set(self._COPIED_FIELDS)
                 | self._LOGGED_FIELDS)
        return sorted(name for name, value in vars(self).items() if name not in plain
                      and (name not in self._JOURNALED_FIELDS or not journaled(value)))

    # -- lookups and argument checks --
    def _seq(self, seq_id: int) -> HeldSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if seq_id in self._swapped:
                raise UnknownSequenceError(f"sequence {seq_id} is swapped out, not resident")
            raise UnknownSequenceError(f"unknown sequence {seq_id} (never allocated, or freed)")
        return seq

    def _put_seq(self, seq_id: int, seq: HeldSeq) -> None:
        """Make ``seq`` resident (logged inside a transaction: ``_seqs`` is a plain dict)."""
        self._cell.log(put_back, self._seqs, seq_id, self._seqs.get(seq_id, MISSING))
        self._seqs[seq_id] = seq

    def _drop_seq(self, seq_id: int) -> None:
        seq = self._seqs[seq_id]
        self._cell.log(dict.__setitem__, self._seqs, seq_id, seq)   # first: a true log
        del self._seqs[seq_id]

    def _changing(self, seq_id: int) -> HeldSeq:
        """``_seq`` for a call about to change the record: saved first inside a transaction."""
        seq = self._seq(seq_id)
        self._cell.record(seq)
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
                 namespace: Optional[str]) -> HeldSeq:
        return HeldSeq(num_tokens, None if token_ids is None else list(token_ids), namespace)

    @staticmethod
    def _check_append_ids(num_tokens: int, token_ids: Optional[Sequence[int]]) -> None:
        check_int("num_tokens", num_tokens, 0)
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ConfigError(f"token_ids has {len(token_ids)} ids for num_tokens={num_tokens}")
        if token_ids is not None:
            token_bytes(token_ids)

    # -- ops --
    def take_ops(self) -> list:
        ops, self._ops = self._ops, []
        return ops

    # -- release --
    def free(self, seq_id: int, computed_tokens: Optional[int] = None) -> None:
        """Release a resident sequence, or drop a swapped one's host copy. ``computed_tokens``
        (when the caller knows fewer tokens were computed than held, e.g. a prefill preempted
        part-way; None: all of them) bounds what is published for later prefix hits, so no
        later request can hit memory whose K/V was never written."""
        if seq_id in self._swapped:
            self._swap_used_tokens -= self._swapped.pop(seq_id).num_tokens
            self._ops.append(DropSwapped(seq_id))
            return
        seq = self._changing(seq_id)
        self._publish_at_free(seq, computed_tokens)
        self._release(seq)
        self._drop_seq(seq_id)

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
        seq = self._changing(seq_id)
        need = seq.num_tokens * self.bytes_per_token
        if need > self.swap_free_bytes:
            raise SwapSpaceExhaustedError(
                f"swapping out sequence {seq_id} needs {need} bytes of swap space, "
                f"{self.swap_free_bytes} of {self.swap_bytes} free")
        self._ops.append(SwapOut(seq_id, seq.num_tokens, **self._swap_location(seq)))
        self._release(seq)
        self._drop_seq(seq_id)
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
        self._cell.record(seq)
        del self._swapped[seq_id]
        self._swap_used_tokens -= seq.num_tokens
        self._place_private(seq_id, seq)
        self._put_seq(seq_id, seq)
        self._ops.append(SwapIn(seq_id, seq.num_tokens, **self._swap_location(seq)))

    def sharing_units(self, seq_ids) -> tuple:
        distinct, summed = set(), 0
        for seq_id in seq_ids:
            ids = [u for u in self._unit_ids(self._seq(seq_id)) if u is not None]
            distinct.update(ids)
            summed += len(ids)
        return len(distinct), summed

    def _unit_ids(self, seq: HeldSeq):
        """The units ``seq`` holds (None: given back behind a window)."""
        return seq.units

    def can_swap_out_all(self, seq_ids) -> bool:
        seqs = [self._seqs.get(i) for i in seq_ids]
        return (all(s is not None and self.can_swap_out(i) for i, s in zip(seq_ids, seqs))
                and sum(s.num_tokens for s in seqs) * self.bytes_per_token <= self.swap_free_bytes)

    def can_swap_in_all(self, seq_ids, adapter=None, extra_tokens: int = 0) -> bool:
        seqs = [self._swapped.get(i) for i in seq_ids]
        if any(s is None for s in seqs) or not self._places_for(len(seqs)):
            return False
        cost = self._adapter_admission_cost(adapter)
        needs = [self._fresh_units(s, extra_tokens) for s in seqs]
        return None not in needs and cost is not None and \
            sum(needs) + cost <= self._available_units()

    def _adapter_admission_cost(self, adapter) -> Optional[int]:
        """Units acquiring ``adapter`` takes from what an allocation may use (None: it cannot
        be acquired; 0 without one). ConfigError from a policy that holds no adapters."""
        if adapter is None:
            return 0
        if not self.can_acquire_adapter(adapter):
            return None
        return self._adapter_kv_cost(adapter)

    def _adapter_kv_cost(self, adapter) -> int:
        return 0

    def _places_for(self, count: int) -> bool:
        """Whether ``count`` sequences can be placed at once besides their memory (vmem: free
        slots)."""
        return True

    def check_idle(self) -> None:
        """What must hold with no sequence resident or swapped (the scheduler's idle steps),
        from the counters the manager keeps where ``check_integrity`` recomputes every table:
        no sequence record or swap space left (one would be a sequence nobody runs or frees),
        then ``_check_idle_memory``."""
        assert not self._seqs and not self._swapped, \
            ("sequences held at idle", sorted(self._seqs)[:8], sorted(self._swapped)[:8])
        assert self._swap_used_tokens == 0, ("swap space used at idle", self._swap_used_tokens)
        self._check_idle_memory()

    def _check_idle_memory(self) -> None:
        """``check_idle``'s part over the manager's own memory: every unit free or held by
        what outlives sequences (prefix cache, idle adapters). Default: ``check_integrity``."""
        self.check_integrity()

    def _swap_integrity(self) -> None:
        assert not (self._seqs.keys() & self._swapped.keys())
        assert self._swap_used_tokens == sum(s.num_tokens for s in self._swapped.values())
        assert 0 <= self._swap_used_tokens * self.bytes_per_token <= self.swap_bytes

    # -- hooks --
    def _publish_at_free(self, seq: HeldSeq, computed_tokens: Optional[int]) -> None:
        """Publish ``seq``'s computed full units before they are released (managers that share;
        ``computed_tokens`` None: all it holds)."""

    def _swap_location(self, seq: HeldSeq) -> dict:
        """Where a sequence's tokens are, for SwapOut/SwapIn ops (vmem: slot; paged: blocks)."""
        return {}

    @abstractmethod
    def _release(self, seq: HeldSeq) -> None:
        """Give back everything resident ``seq`` holds (its record stays for the caller)."""

    @abstractmethod
    def _fresh_units(self, seq: HeldSeq, extra_tokens: int = 0) -> Optional[int]:
        """Free units placing ``seq`` privately would take (with room for ``extra_tokens``
        more); None when it cannot be placed now."""

    @abstractmethod
    def _available_units(self) -> int:
        """Units a new allocation may take (free + reclaimable)."""

    @abstractmethod
    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        """Hold private memory for ``seq.num_tokens`` tokens (swap-in); room was checked."""

    @abstractmethod
    def _raise_no_room(self, what: str) -> None:
        """Raise OutOfCapacityError for ``what``, naming what is free."""
