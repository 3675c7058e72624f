"""What a manager's ``stats()`` and ``adapter_stats()`` return: snapshots of its accounting.

Every manager's ``MemoryStats`` keeps its invariants (``broken_invariant``); the simulator
refuses a user's policy that breaks them where it reads its figures (``base.check_stats``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AdapterStats:
    """A manager's adapters: resident ones (``pinned`` by running sequences, the rest idle),
    the pool pages (vmem) or blocks (paged) they hold, and loads/evictions since construction."""
    resident: int = 0
    pinned: int = 0
    pages: int = 0
    idle_pages: int = 0
    loads: int = 0
    evictions: int = 0

    @property
    def idle(self) -> int:
        return self.resident - self.pinned


@dataclass(frozen=True)
class MemoryStats:
    """A snapshot of a manager's accounting, in tokens (bytes = tokens * bytes_per_token).
    Invariants, every count an int: 0 <= live <= allocated <= total, 0 <= free <= total,
    end waste >= 0, bytes_per_token >= 1."""
    total_tokens: int        # capacity of the whole cache
    allocated_tokens: int    # total - free: held by sequences, plus (vmem) pages still mapped
                             # under freed slots (reclaimable)
    live_tokens: int         # tokens actually cached, summed over sequences (shared counted once)
    free_tokens: int         # paged: free + cached blocks (as vLLM counts them); vmem: unmapped
                             # page groups only (admission may also reclaim reclaimable ones)
    end_waste_tokens: int    # held by live sequences but past their last token
    bytes_per_token: int

    @property
    def allocated_bytes(self) -> int:
        return self.allocated_tokens * self.bytes_per_token

    @property
    def utilization(self) -> float:
        """live / allocated; 1.0 when nothing is allocated."""
        return self.live_tokens / self.allocated_tokens if self.allocated_tokens else 1.0

    @property
    def usage_fraction(self) -> float:
        """What vLLM calls kv_cache_usage_perc (as a fraction): 1 - free / total."""
        return 1.0 - self.free_tokens / self.total_tokens if self.total_tokens else 0.0

    def broken_invariant(self) -> Optional[str]:
        """The first invariant (class docstring) this snapshot breaks, or None. O(1)."""
        live, allocated, total = self.live_tokens, self.allocated_tokens, self.total_tokens
        free, waste, token_bytes = self.free_tokens, self.end_waste_tokens, self.bytes_per_token
        if not (type(live) is type(allocated) is type(total) is type(free) is type(waste)
                is type(token_bytes) is int):
            return "every count an int (not a bool or a float)"
        if not 0 <= live <= allocated <= total:
            return "0 <= live_tokens <= allocated_tokens <= total_tokens"
        if not 0 <= free <= total:
            return "0 <= free_tokens <= total_tokens"
        if waste < 0:
            return "end_waste_tokens >= 0"
        if token_bytes < 1:
            return "bytes_per_token >= 1"
        return None
