"""The memory-manager interface (and the memory ops of ops.py, the stats of stats.py, re-exported).

A manager is the ONE place where KV allocation is decided. It is pure bookkeeping over ints: it
never touches memory. Every change it makes to what is mapped, copied or swapped is appended to
its pending op list, in execution order, and drained with ``take_ops()`` by whoever executes
it (the runtime cache on real memory, or the simulator, which only counts).

Sequences are identified by caller-chosen ints (``seq_id``). Operations come in pairs that ask
before they commit (``can_allocate``/``allocate``, ``can_append``/``append``, ...); a commit
without room raises ``OutOfCapacityError`` and leaves state unchanged. What a user's manager
returns is checked against this interface (``check_hit``, ``check_stats``: ManagerContractError).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence, Tuple

from ..adapters import AdapterRef
from ..errors import ConfigError, PolicyError
from ..layout import CacheLayout
from .ops import (CopyBlock, CopyExtent, DropSwapped, EvictAdapter, LoadAdapter,  # noqa: F401
                  MapExtent, MemoryOp, ReleasePages, SwapIn, SwapOut, UnmapExtent)
from .stats import AdapterStats, MemoryStats  # noqa: F401 (re-exported)


class ManagerContractError(PolicyError):
    """A manager returned what this interface rules out (a user's policy: the built-in managers
    never do): the message names the class, the method and the value. Raised before the value
    is used, so no figure is ever computed from it."""


def _culprit(manager: "MemoryManager", method: str) -> str:
    return f"policy {manager.name!r}: {type(manager).__name__}.{method}"


def check_hit(manager: "MemoryManager", hit, num_tokens: int,
              token_ids: Optional[Sequence[int]] = None, lookup: bool = True, share_from: Optional[Tuple[int, int]] = None) -> None:
    """ManagerContractError unless ``hit``, what ``manager.allocate`` returned for these
    arguments, is what its docstring allows: an int (not a bool) from 0 to the tokens it could
    hit: ``share_from``'s (at most ``num_tokens``); else, with ``token_ids`` and ``lookup``,
    at most ``num_tokens`` and ``len(token_ids)``; else none (0)."""
    if share_from is not None:
        limit, why = min(num_tokens, share_from[1]), f"sharing {share_from[1]} tokens"
    elif token_ids is not None and lookup:
        limit, why = min(num_tokens, len(token_ids)), f"{len(token_ids)} token ids"
    else:
        limit, why = 0, "no token ids" if token_ids is None else "lookup=False"
    if type(hit) is not int or not 0 <= hit <= limit:
        raise ManagerContractError(
            f"{_culprit(manager, 'allocate')} returned {hit!r} ({type(hit).__name__}) for "
            f"{num_tokens} tokens with {why}: it must return the leading tokens already cached, "
            f"an int from 0 to {limit}")


def check_stats(manager: "MemoryManager", stats, usage=None) -> None:
    """ManagerContractError naming the method and the broken invariant unless ``stats`` (from
    ``manager.stats()``) is a MemoryStats keeping its invariants and ``usage`` (None: unread),
    its ``kv_cache_usage()``, a fraction in [0, 1] (O(1): the simulator reads them each step)."""
    broken = stats.broken_invariant() if isinstance(stats, MemoryStats) else "a MemoryStats"
    if broken is not None:
        raise ManagerContractError(f"{_culprit(manager, 'stats()')} returned {stats!r}; "
                                   f"required: {broken}")
    if usage is not None and (type(usage) not in (float, int) or not 0.0 <= usage <= 1.0):
        raise ManagerContractError(f"{_culprit(manager, 'kv_cache_usage()')} returned "
                                   f"{usage!r}; required: a fraction in [0, 1]")


class MemoryManager(ABC):
    """Decides every KV allocation for a set of sequences. This class is the whole interface
    callers (scheduler, simulator, engine) may use; layout-specific queries (``block_table``,
    ``slot_of``) belong to the paged and vmem managers and are used only by their caches.

    Guarantees, for every implementation:
    - ``check_integrity()`` holds after every public call (free + held == total, reference
      counts equal the number of holders);
    - a call that raises leaves every counter, table and the pending op list unchanged;
    - ``take_ops()`` returns every op since the last call, in the order they must execute;
    - ``rollback()`` puts back exactly the state at ``begin()`` (tables, counters, sequence
      records, pending ops), whatever ran in between.
    """

    name: str = "abstract"   # the policy, as make_manager names it ("paged", "vmem", ...)
    max_seq_len: int         # tokens one sequence may reach (prompt + output), as configured
    bytes_per_token: int     # K/V bytes of one token of every layer (swap space counts these)
    prefix_queries: int = 0  # tokens offered to allocate with token ids (0: no prefix sharing)
    prefix_hits: int = 0     # of those, tokens found cached
    holds_final_length: bool = False  # True: a sequence holds its final length from admission,
                                      # so it never grows into free memory (reserve policies)
    prefix_eviction: str = "off"   # what happens to computed units nobody holds (eviction.py)
    prefix_unit_tokens: int = 0    # tokens per shareable unit (0: shares nothing)
    fork_unit_tokens: int = 0      # tokens per unit a fork shares whole (0: a fork copies)

    @property
    @abstractmethod
    def max_sequence_tokens(self) -> int:
        """The longest sequence this manager could ever hold (``max_seq_len`` capped by the
        cache); the scheduler rejects longer requests at submission."""

    @property
    def max_sequence_tokens_at_max(self) -> int:
        """``max_sequence_tokens`` with the pool at ``max_cache_bytes`` (a fixed pool: the same)."""
        return self.max_sequence_tokens

    def pool_units(self, cache_bytes: int) -> int:
        """Units (paged blocks, vmem pages) ``cache_bytes`` buys, at most the max (0: none)."""
        return 0

    @property
    def pool_sequence_tokens(self) -> int:
        """Tokens of one sequence the pool holds now, whole in every layer (not capped by
        ``max_seq_len``; a paged hybrid's ``stats`` count tokens of one block group)."""
        return self.stats().total_tokens

    @property
    def pages_per_map_op(self) -> int:
        """Pages one group's mapping maps (map latency is per page): 1, vmem its pages_per_group."""
        return 1

    # -- admission and growth --
    @abstractmethod
    def can_allocate(self, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                     namespace: Optional[str] = None, reserve_tokens: int = 0,
                     final_tokens: Optional[int] = None,
                     adapter: Optional[AdapterRef] = None,
                     share_from: Optional[Tuple[int, int]] = None, lookup: bool = True) -> bool:
        """Whether ``allocate`` of ``num_tokens`` would succeed while leaving at least
        ``reserve_tokens`` of capacity free (the scheduler's admission watermark).
        ``final_tokens`` is the sequence's final length: reserve-oracle needs it (and raises
        ConfigError without it), the other managers ignore it. ``adapter``: whether
        ``acquire_adapter(adapter)`` and then this allocation would both succeed (the pages
        the adapter takes are not the allocation's). ``share_from``, ``lookup``: as ``allocate``'s."""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None,
                 share_from: Optional[Tuple[int, int]] = None, lookup: bool = True) -> int:
        """Hold room for a new sequence's first ``num_tokens`` tokens. ``token_ids`` and
        ``namespace`` enable prefix sharing; ``lookup`` False: no prefix hit and no query
        counted (every token computed: prompt logprobs), its units still published under
        ``namespace`` for later requests; ``final_tokens`` is the sequence's final length
        (only reserve-oracle uses it); ``share_from`` = (resident sibling, tokens): hold the
        sibling's units of those first tokens (whole units a fork shares, equal to this
        sequence's and computed before it reads them: the caller knows) instead of prefix hits, as a fork would; only
        managers with ``fork_unit_tokens`` take it. Returns how many leading tokens are
        already cached (a prefix-sharing hit: their K/V need not be computed), an int from 0
        to ``num_tokens``: at most ``share_from``'s tokens with it, else ``len(token_ids)``;
        0 without either or with ``lookup`` False (``check_hit``: the scheduler refuses others)."""

    @abstractmethod
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool:
        """Whether ``append(seq_id, num_tokens)`` would succeed."""

    @abstractmethod
    def append(self, seq_id: int, num_tokens: int = 1,
               token_ids: Optional[Sequence[int]] = None) -> None:
        """Grow a sequence by ``num_tokens`` (copy-on-write of a shared partial page/block
        happens here)."""

    @abstractmethod
    def can_fork(self, parent_id: int) -> bool:
        """Whether ``fork(parent_id, ...)`` would succeed."""

    @abstractmethod
    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing all of its memory."""

    @abstractmethod
    def free(self, seq_id: int, computed_tokens: Optional[int] = None) -> None:
        """Release a sequence (finished, or preempted for recompute). ``computed_tokens``: how
        many of its tokens have K/V written, when fewer than it holds; the rest must never be
        shared through the prefix cache."""

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens of resident ``seq_id`` have their K/V written (said
        after each step): only now may its full units serve prefix hits ("publish on compute");
        ``free`` publishes what it is told was computed. No-op for managers that share nothing."""

    def unpublish(self, seq_id: int) -> None:
        """Resident or swapped ``seq_id``'s K/V may be wrong (its request failed): no later
        prompt finds what it published or hit, nor what it computes next (``free`` included)."""

    def unpublish_tokens(self, token_ids: Sequence[int], namespace: Optional[str]) -> None:
        """``unpublish`` for a sequence held no more (preempted for recompute, then failed while
        waiting): no later prompt finds the units ``token_ids`` under ``namespace`` reach."""

    @property
    def cached_tokens(self) -> int:
        """Tokens held only by the prefix cache: computed, findable, held by no sequence, each
        counted once (a paged hybrid's cached prefix block once, not once per block group);
        they count as free for ``kv_cache_usage`` and are evicted when memory is needed."""
        return 0

    def reset_prefix_cache(self) -> int:
        """Evict every cached-but-free unit; returns how many (0: nothing is retained)."""
        return 0

    def kv_cache_usage(self) -> float:
        """vLLM's kv_cache_usage_perc as a fraction: held memory over the cache (cached: free)."""
        return self.stats().usage_fraction

    # -- sliding windows --
    @property
    def window_tokens(self) -> Optional[int]:
        """The window (tokens) behind which this manager gives memory back, or None (it keeps
        every token: no model window, a layer without one, or a policy that cannot). A hybrid
        vmem manager names its windowed layers' window, giving back their part of each group."""
        return None

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """The next step's earliest query of ``seq_id`` is at ``computed_tokens``: give back units
        wholly behind every layer's window (before ``computed_tokens - window_tokens + 1``)."""

    # -- swap --
    @abstractmethod
    def swap_out(self, seq_id: int) -> int:
        """Emit SwapOut then release the sequence's device memory; returns tokens swapped.
        The sequence stays known to the manager as swapped."""

    @abstractmethod
    def can_swap_out(self, seq_id: int) -> bool:
        """Whether ``swap_out(seq_id)`` would succeed (the sequence is resident and its tokens
        fit in the free host swap space; False for an unknown one)."""

    @abstractmethod
    def can_swap_in(self, seq_id: int) -> bool:
        """Whether ``swap_in(seq_id)`` would succeed."""

    @abstractmethod
    def swap_in(self, seq_id: int) -> None:
        """Re-allocate a swapped sequence and emit SwapIn."""

    @abstractmethod
    def sharing_units(self, seq_ids) -> tuple:
        """(distinct units, units counted once per sequence) that ``seq_ids`` (resident) hold:
        paged blocks, vmem page groups; the second is what they would hold if each kept a
        private copy of what they share (forks, beams). Units given back behind a window are
        not counted; a reserve policy shares nothing."""

    @abstractmethod
    def can_swap_out_all(self, seq_ids) -> bool:
        """Whether every one of ``seq_ids`` can be swapped out in one go (a beam group: each
        stores its own copy of the units they share, so the swap space must hold them all)."""

    @abstractmethod
    def can_swap_in_all(self, seq_ids, adapter: Optional[AdapterRef] = None,
                        extra_tokens: int = 0) -> bool:
        """Whether every one of ``seq_ids`` (swapped out) can be swapped in in one go (a beam
        group comes back whole: each its own private memory), each with room for
        ``extra_tokens`` more; ``adapter``: after ``acquire_adapter(adapter)``."""

    # -- transactions (the one failure mechanism: a failed step is undone exactly) --
    @abstractmethod
    def begin(self) -> None:
        """Open a transaction (TransactionStateError if one is open: they do not nest)."""

    @abstractmethod
    def commit(self) -> None:
        """Keep every change since ``begin`` (TransactionStateError without one)."""

    @abstractmethod
    def rollback(self) -> None:
        """Undo every change since ``begin`` (TransactionStateError without one)."""

    @property
    @abstractmethod
    def in_transaction(self) -> bool:
        """Whether ``begin`` was called without a ``commit``/``rollback`` since."""

    # -- queries --
    @abstractmethod
    def num_tokens(self, seq_id: int) -> int:
        """Live tokens of a resident or swapped sequence (UnknownSequenceError otherwise)."""

    @abstractmethod
    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence is held in host swap space (not resident)."""

    @abstractmethod
    def stats(self) -> MemoryStats:
        """Accounting snapshot."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert internal invariants (AssertionError on a bug)."""

    def check_idle(self) -> None:
        """``check_integrity`` with no sequence resident or swapped (a manager may check less)."""
        self.check_integrity()

    @abstractmethod
    def take_ops(self) -> list:
        """Drain and return the pending memory ops, in execution order."""

    def copied_bytes(self, ops: list) -> int:
        """K/V bytes the copy ops among ``ops`` (this manager's) move on the device (what the
        simulator charges at the copy bandwidth); 0 for a manager that emits none."""
        return 0

    def swapped_bytes(self, ops: list) -> int:
        """K/V bytes the ``SwapOut`` / ``SwapIn`` ops among ``ops`` move between host and
        device (what the simulator charges at the host-to-device bandwidth): each op's tokens
        at ``bytes_per_token``, as swap space counts them."""
        return sum(op.num_tokens for op in ops
                   if type(op) is SwapOut or type(op) is SwapIn) * self.bytes_per_token

    # -- LoRA adapters (vmem and paged, managers/adapters.py; the others refuse by name) --
    # An adapter is held by use counts: ``acquire_adapter`` pins it (loading it into pages
    # taken from the ledger when it is not resident: LoadAdapter), ``release_adapter`` unpins;
    # at zero it stays resident but IDLE, and idle adapters are evicted (least recently idle
    # first, EvictAdapter) when KV or another adapter needs their pages, after the prefix
    # cache's memory and before any allocation fails.
    def _no_adapters(self):
        raise ConfigError(f"policy {self.name!r} cannot hold LoRA adapters (only 'vmem' and "
                          f"'paged' can: adapters take pool pages or blocks)")

    def adapter_pages(self, num_bytes: int) -> int:
        """Ledger units (vmem pool pages, paged blocks) an adapter of ``num_bytes`` takes."""
        self._no_adapters()

    def max_adapter_pages(self) -> int:
        """The most units adapters could ever hold at once (a bigger one can never load)."""
        self._no_adapters()

    def max_sequence_tokens_with_adapter(self, adapter: AdapterRef,
                                         cache_bytes: Optional[int] = None) -> int:
        """``max_sequence_tokens`` while ``adapter`` is resident (0: it can never load), in a
        pool of ``cache_bytes`` (one ``resize`` could set; None: as it is; a fixed pool: one)."""
        self._no_adapters()

    def kv_units_beside_adapter(self, adapter: AdapterRef,
                                cache_bytes: Optional[int] = None) -> int:
        """Pool units KV may hold while ``adapter`` is resident, in a pool of ``cache_bytes``
        (None: as it is); -1 when the adapter can never load."""
        self._no_adapters()

    def can_acquire_adapter(self, adapter: AdapterRef) -> bool:
        """Whether ``acquire_adapter(adapter)`` would succeed."""
        self._no_adapters()

    def acquire_adapter(self, adapter: AdapterRef, owner_seq_id: Optional[int] = None) -> None:
        """Pin ``adapter`` (one use more), loading it first when it is not resident (its pages
        from free ones, then reclaimed KV memory as ``resize`` gathers it, then idle adapters';
        ``LoadAdapter`` serving ``owner_seq_id``). OutOfCapacityError, nothing changed, when
        it cannot fit."""
        self._no_adapters()

    def release_adapter(self, adapter: AdapterRef) -> None:
        """One use fewer (AdapterStateError when it has none); at zero it stays resident, idle."""
        self._no_adapters()

    def evict_idle_adapter(self) -> bool:
        """Unload the least recently idle adapter (``EvictAdapter``); False when none is idle."""
        return False

    def adapter_uses(self, adapter: AdapterRef) -> int:
        """Running uses of ``adapter`` (0: idle or not resident)."""
        return 0

    def resident_adapters(self) -> dict:
        """{adapter_id: (pool_pages, num_bytes)} of every resident adapter, as the ops named
        them (an executor's replica must equal it)."""
        return {}

    def adapter_stats(self) -> AdapterStats:
        """Counts of the resident adapters and their pages, loads and evictions."""
        return AdapterStats()

    # -- elastic memory (vmem only; the others refuse by name) --
    @property
    def cache_bytes(self) -> int:
        """Bytes of device memory the pool may use now (what ``resize`` last set; a paged
        hybrid's stats count tokens of one block group, at that group's bytes)."""
        stats = self.stats()
        return stats.total_tokens * stats.bytes_per_token

    @property
    def max_cache_bytes(self) -> int:
        """The most ``resize`` may grow the pool to (the ids reserved at construction)."""
        return self.cache_bytes

    @property
    def resize_step_bytes(self) -> int:
        """The granularity ``resize`` rounds ``cache_bytes`` down to (0: it cannot resize)."""
        return 0

    def resize(self, cache_bytes: int) -> int:
        """Let the pool use ``cache_bytes`` (rounded down as at construction): growing puts
        pages given back into service (no op), shrinking gives back free pages, then those of
        unused and cached groups (UnmapExtent, ReleasePages ops). Returns the bytes it could
        not free (0: done; the rest is held by sequences: preempt them and call again). Call
        inside a transaction to undo a partial shrink."""
        raise ConfigError(f"policy {self.name!r} cannot resize its cache at run time (only "
                          f"'vmem' can: its pages are mapped one by one)")

    def layout(self) -> CacheLayout:
        """The cache an executor must build to run this manager's plans (plain data; equal on
        every call). ConfigError for a policy whose plans no cache executes (reserve-*:
        simulator only)."""
        raise ConfigError(f"a cache needs a 'vmem' or 'paged' memory manager, got {self.name!r} "
                          f"(its plans are for the simulator only)")
