"""Reservation managers: contiguous capacity held per sequence at admission, as systems worked
before paging. ``reserve-max`` holds ``max_seq_len`` tokens for every sequence,
``reserve-oracle`` exactly its final length (an upper bound on what reservation can achieve).

They emit no map/copy ops (a reservation is one contiguous range fixed at admission; fork copies
nothing because nothing is shared): only SwapOut/SwapIn.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError, OutOfCapacityError, RequestTooLargeError
from ..presets import ModelSpec
from .base import MemoryStats
from .common import ManagerCore, check_int
from .prefix import HeldSeq


class ReserveManager(ManagerCore):
    """Holds ``max_seq_len`` (``oracle=False``) or ``final_tokens`` (``oracle=True``) tokens per
    sequence from admission to free. Append beyond the reservation is refused. Capacity in
    tokens: ``cache_bytes // model.bytes_per_token``."""

    holds_final_length = True

    def __init__(self, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 oracle: bool = False, swap_bytes: int = 0) -> None:
        super().__init__(model, max_seq_len_tokens, swap_bytes)
        self.oracle = oracle
        self.name = "reserve-oracle" if oracle else "reserve-max"
        self.total_tokens = check_int("cache_bytes", cache_bytes, 1) // self.bytes_per_token
        if not oracle and self.total_tokens < self.max_seq_len:
            raise ConfigError(
                f"cache_bytes={cache_bytes} holds {self.total_tokens} tokens, fewer than one "
                f"max_seq_len_tokens={self.max_seq_len} reservation; reserve-max needs "
                f"cache_bytes >= {self.max_seq_len * self.bytes_per_token}")
        self._held = 0      # tokens reserved by resident sequences
        self._live = 0      # tokens cached by resident sequences

    _FIXED_FIELDS = ManagerCore._FIXED_FIELDS | {"oracle", "name", "total_tokens"}
    _SAVED_FIELDS = ManagerCore._SAVED_FIELDS + ("_held", "_live")

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_seq_len, self.total_tokens)

    # -- reservation size --
    def reservation_tokens(self, final_tokens: int) -> int:
        """Tokens a sequence of ``final_tokens`` at most holds from admission (unchecked)."""
        return final_tokens if self.oracle else self.max_seq_len

    def _reservation(self, num_tokens: int, final_tokens: Optional[int]) -> int:
        """Tokens to hold for a new sequence (raises on bad arguments, changes nothing)."""
        self._check_length(num_tokens)
        if not self.oracle:
            return self.max_seq_len
        if final_tokens is None:
            raise ConfigError("reserve-oracle needs final_tokens (the sequence's final length)")
        self._check_length(final_tokens, "final_tokens")
        if final_tokens < num_tokens:
            raise ConfigError(f"final_tokens={final_tokens} is below num_tokens={num_tokens}")
        return final_tokens

    # -- admission and growth --
    def can_allocate(self, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                     namespace: Optional[str] = None, reserve_tokens: int = 0,
                     final_tokens: Optional[int] = None, adapter=None, lookup: bool = True) -> bool:
        if adapter is not None:
            self._no_adapters()
        try:
            need = self._reservation(num_tokens, final_tokens)
        except RequestTooLargeError:
            return False
        return self.total_tokens - self._held - need >= reserve_tokens

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None,
                 lookup: bool = True) -> int:
        self._check_new(seq_id)
        need = self._reservation(num_tokens, final_tokens)
        if need > self.total_tokens - self._held:
            raise OutOfCapacityError(f"sequence {seq_id} needs {need} tokens reserved, "
                                     f"{self.total_tokens - self._held} free")
        seq = HeldSeq(num_tokens, None, namespace)
        seq.reserved = need
        self._put_seq(seq_id, seq)
        self._held += need
        self._live += num_tokens
        if token_ids is not None and lookup:
            self.prefix_queries += num_tokens
        return 0

    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        return seq.num_tokens + num_tokens <= seq.reserved

    def append(self, seq_id: int, num_tokens: int = 1,
               token_ids: Optional[Sequence[int]] = None) -> None:
        seq = self._changing(seq_id)
        new = seq.num_tokens + num_tokens
        if new > seq.reserved:
            self._check_append_ids(num_tokens, token_ids)
            if new > self.max_seq_len:
                raise RequestTooLargeError(f"sequence {seq_id} would grow to {new} tokens, "
                                           f"over max_seq_len {self.max_seq_len}")
            raise OutOfCapacityError(f"sequence {seq_id} would grow to {new} tokens, "
                                     f"over its reservation of {seq.reserved}")
        if num_tokens < 0:
            self._check_append_ids(num_tokens, token_ids)
        seq.num_tokens = new
        self._live += num_tokens

    def can_fork(self, parent_id: int) -> bool:
        return self._seq(parent_id).reserved <= self.total_tokens - self._held

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        self._check_new(child_id)
        if not self.can_fork(parent_id):
            self._raise_no_room(f"forking sequence {parent_id} ({parent.reserved} tokens)")
        child = parent.copy()
        self._put_seq(child_id, child)
        self._held += child.reserved
        self._live += child.num_tokens

    # -- hooks --
    def _release(self, seq: HeldSeq) -> None:
        self._held -= seq.reserved
        self._live -= seq.num_tokens

    def _fresh_units(self, seq: HeldSeq, extra_tokens: int = 0) -> Optional[int]:
        return seq.reserved          # its whole length, reserved at admission

    def _available_units(self) -> int:
        return self.total_tokens - self._held

    def _place_private(self, seq_id: int, seq: HeldSeq) -> None:
        self._held += seq.reserved
        self._live += seq.num_tokens

    def _raise_no_room(self, what: str) -> None:
        raise OutOfCapacityError(f"{what}: {self.total_tokens - self._held} tokens free")

    # -- queries --
    def stats(self) -> MemoryStats:
        return MemoryStats(total_tokens=self.total_tokens, allocated_tokens=self._held,
                           live_tokens=self._live, free_tokens=self.total_tokens - self._held,
                           end_waste_tokens=self._held - self._live,
                           bytes_per_token=self.bytes_per_token)

    def check_integrity(self) -> None:
        seqs = self._seqs.values()
        assert self._held == sum(s.reserved for s in seqs)
        assert self._live == sum(s.num_tokens for s in seqs)
        assert all(0 <= s.num_tokens <= s.reserved <= self.max_seq_len for s in seqs)
        assert 0 <= self._held <= self.total_tokens
        self._swap_integrity()

    def _check_idle_memory(self) -> None:
        assert self._held == self._live == 0, ("tokens reserved at idle", self._held, self._live)
