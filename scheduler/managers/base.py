"""The memory-manager interface and the memory operations a manager plans.

A manager is the ONE place where KV allocation is decided. It is pure bookkeeping over ints: it
never touches memory. Every change it makes to what is mapped, copied or swapped is appended to
its pending op list, in execution order, and drained with ``take_ops()`` by whoever executes
it (the runtime cache on real memory, or the simulator, which only counts).

Sequences are identified by caller-chosen ints (``seq_id``). Operations come in pairs that ask
before they commit (``can_allocate``/``allocate``, ``can_append``/``append``, ...); a commit
without room raises ``OutOfCapacityError`` and leaves state unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ..errors import ConfigError
from ..layout import CacheLayout


# ---- memory operations -------------------------------------------------------------------
# vmem mode. A "page group" is every physical page that backs one run of tokens_per_page tokens
# of one slot across all layers' K and V: 2 * num_layers members in the per-layer layout, 2 in
# the interleaved layout, each member k >= 1 pages (the fewest holding whole tokens; see
# scheduler.geometry). Group g is a fixed set of physical pages; the manager hands out groups.

# A hybrid model (full-attention layers beside sliding-window ones) in the per-layer layout
# splits every group into two PARTS: the members of its full layers and those of its windowed
# layers, so a sequence can give back the windowed part of a group behind the window while it
# keeps the full part. Its pool binds physical pages to a group's part at the first MapGroup that
# needs them and takes them back at ReleaseGroup (see GroupPart). Every other cache maps whole
# groups ("all") over fixed pages, except where a member spans k > 1 pages: there a group is
# backed only by the member pages its tokens' bytes need (ResizeGroup; managers/vmem_bytes.py).

# Every op has an ``owner``: the seq id of the one sequence it serves (whose manager call emitted
# it), or None. The engine blames a failed op on ``ops[op_index].owner`` alone, without reading
# the manager back (runtime/engine/lifecycle.py). Ops that grow or copy memory for a sequence
# name it: MapGroup; ResizeGroup fitting a group it holds to its fill; CopyGroup and CopyBlock
# (the writer that moved off a shared partial unit); the swaps (their seq_id). Ops that reclaim
# (UnmapGroup, ReleaseGroup, a ResizeGroup that shrinks an unheld group) serve whoever takes the
# memory next and name nobody, even when one sequence's allocation triggered them. No op serves
# several: a shared group is mapped once per holder slot, each MapGroup by its own holder, and a
# shared partial unit is copied for its one writer. ``owner`` is blame metadata: ops compare
# equal by the memory they touch (compare=False); a reclaiming op has it as a class constant,
# adding nothing to a plan's pickle (an owned op's int adds 7 bytes, docs/benchmarks.md).

class GroupPart:
    """Which members of a page group an op touches (a str constant; pickles as a plain str)."""
    ALL = "all"            # every member (every cache)
    FULL = "full"          # members of the full-attention layers (hybrid per-layer only)
    WINDOW = "window"      # members of the sliding-window layers (hybrid per-layer only)
    NAMES = (ALL, FULL, WINDOW)


@dataclass(frozen=True)
class MapGroup:
    """Map ``part`` of page group ``group`` under ``slot`` at page index ``page_index`` (tokens
    [page_index * tokens_per_page, (page_index + 1) * tokens_per_page) of that slot); on a
    hybrid pool, pages are bound to the part first if it has none; on a byte-mapped pool it
    maps the group's backed pages (none yet for a fresh group: a ResizeGroup follows)."""
    slot: int
    page_index: int
    group: int
    part: str = GroupPart.ALL
    owner: Optional[int] = field(default=None, compare=False)  # the seq served


@dataclass(frozen=True)
class UnmapGroup:
    """Unmap ``part`` of what is mapped under ``slot`` at ``page_index`` (it is ``group``); the
    pages stay bound to the group (on a hybrid pool, until ReleaseGroup)."""
    slot: int
    page_index: int
    group: int
    part: str = GroupPart.ALL
    owner = None      # reclaiming: serves whoever takes the memory next (not a field)


@dataclass(frozen=True)
class ReleaseGroup:
    """Hybrid pools only: the physical pages bound to ``part`` of ``group`` go back to the free
    pages (the part is mapped nowhere when this runs); a later MapGroup binds fresh ones."""
    group: int
    part: str = GroupPart.ALL
    owner = None      # reclaiming: serves whoever takes the memory next (not a field)


@dataclass(frozen=True)
class ResizeGroup:
    """Byte-mapped pools only (``pool_pages`` without parts: members spanning k > 1 pages,
    scheduler.geometry): from now on each member of ``group`` is backed by its first
    ``member_pages`` pages (0..k). Growing binds free pool pages to the new ones and maps them
    wherever the group is mapped; shrinking unmaps the dropped ones everywhere and frees them.
    Every mapping of a group always maps exactly its backed pages (a MapGroup maps those)."""
    group: int
    member_pages: int
    owner: Optional[int] = field(default=None, compare=False)  # the seq served


@dataclass(frozen=True)
class CopyGroup:
    """Copy the bytes of the page group mapped at one (slot, page_index) into the group mapped
    at another (every backed member page of the source; the destination is backed at least as
    far); both are mapped when this op runs. Used for copy-on-write of a shared partial page
    group."""
    src_slot: int
    src_page_index: int
    dst_slot: int
    dst_page_index: int
    owner: Optional[int] = field(default=None, compare=False)  # the seq served


# paged mode. Blocks live in a preallocated pool; allocating one needs no op, the block table
# is read with ``block_table(seq_id)``.

@dataclass(frozen=True)
class CopyBlock:
    """Copy block ``src_block`` into block ``dst_block`` (copy-on-write of a partial block)."""
    src_block: int
    dst_block: int
    owner: Optional[int] = field(default=None, compare=False)  # the seq served


# both modes

@dataclass(frozen=True)
class SwapOut:
    """Copy the first ``num_tokens`` cached tokens of ``seq_id`` to host swap space. Emitted
    before the ops that release the sequence's device memory. The op names where the tokens
    are (``slot`` in vmem mode, ``blocks`` in paged mode), because by the time the runtime
    executes it the manager no longer holds that memory for the sequence."""
    seq_id: int
    num_tokens: int
    slot: Optional[int] = None
    blocks: tuple = ()

    @property
    def owner(self) -> int:
        return self.seq_id


@dataclass(frozen=True)
class SwapIn:
    """Copy ``num_tokens`` tokens of ``seq_id`` back from host swap space into its (newly
    allocated) device memory -- ``slot`` in vmem mode, ``blocks`` in paged mode -- then drop
    the host copy. Emitted after the ops that allocate."""
    seq_id: int
    num_tokens: int
    slot: Optional[int] = None
    blocks: tuple = ()

    @property
    def owner(self) -> int:
        return self.seq_id


@dataclass(frozen=True)
class DropSwapped:
    """Forget the host copy of ``seq_id``: it was freed while swapped out (nothing to copy)."""
    seq_id: int

    @property
    def owner(self) -> int:
        return self.seq_id


MemoryOp = Union[MapGroup, UnmapGroup, ReleaseGroup, ResizeGroup, CopyGroup, CopyBlock, SwapOut, SwapIn, DropSwapped]


@dataclass(frozen=True)
class MemoryStats:
    """A snapshot of a manager's accounting, in tokens (bytes = tokens * bytes_per_token)."""
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
    prefix_queries: int = 0  # tokens offered to allocate with token ids (0: no prefix sharing)
    prefix_hits: int = 0     # of those, tokens found cached
    holds_final_length: bool = False  # True: a sequence holds its final length from admission,
                                      # so it never grows into free memory (reserve policies)
    prefix_eviction: str = "off"   # what happens to computed units nobody holds (eviction.py)
    prefix_unit_tokens: int = 0    # tokens per shareable unit (0: shares nothing)

    @property
    @abstractmethod
    def max_sequence_tokens(self) -> int:
        """The longest sequence this manager could ever hold (``max_seq_len`` capped by the
        cache); the scheduler rejects longer requests at submission."""

    @property
    def pages_per_map_op(self) -> int:
        """Physical pages one MapGroup op maps (the cost model charges map latency per page).
        1 unless the manager maps page groups (vmem: its pages_per_group)."""
        return 1

    # -- admission and growth --
    @abstractmethod
    def can_allocate(self, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                     namespace: Optional[str] = None, reserve_tokens: int = 0,
                     final_tokens: Optional[int] = None) -> bool:
        """Whether ``allocate`` of ``num_tokens`` would succeed while leaving at least
        ``reserve_tokens`` of capacity free (the scheduler's admission watermark).
        ``final_tokens`` is the sequence's final length: reserve-oracle needs it (and raises
        ConfigError without it), the other managers ignore it."""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                 namespace: Optional[str] = None, final_tokens: Optional[int] = None) -> int:
        """Hold room for a new sequence's first ``num_tokens`` tokens. ``token_ids`` and
        ``namespace`` enable prefix sharing; ``final_tokens`` is the sequence's final length
        (only reserve-oracle uses it). Returns how many leading tokens are already cached
        (a prefix-sharing hit: their K/V need not be computed)."""

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
        """The first ``num_tokens`` tokens of resident ``seq_id`` have their K/V written (the
        scheduler says so after each step): only now may its full units serve prefix hits
        ("publish on compute"). ``free`` publishes what it is told was computed. No-op for
        managers that share nothing."""

    @property
    def cached_tokens(self) -> int:
        """Tokens held only by the prefix cache: computed, findable, held by no sequence; they
        count as free for ``kv_cache_usage`` and are evicted when memory is needed."""
        return 0

    def reset_prefix_cache(self) -> int:
        """Evict every cached-but-free unit; returns how many (0: nothing is retained)."""
        return 0

    def kv_cache_usage(self) -> float:
        """vLLM's kv_cache_usage_perc as a fraction: held memory over the cache, cached-but-free
        units counted as free."""
        return self.stats().usage_fraction

    # -- sliding windows --
    @property
    def window_tokens(self) -> Optional[int]:
        """The window (tokens) behind which this manager gives memory back, or None (it keeps
        every token: no model window, a layer without one, or a policy that cannot). A hybrid
        vmem manager (hybrid.py) names its windowed layers' window and gives back only their
        part of each page group."""
        return None

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """The next step's earliest query of ``seq_id`` is at ``computed_tokens``: give back
        the memory of units wholly behind every layer's window (tokens before
        ``computed_tokens - window_tokens + 1``). A no-op without ``window_tokens``."""

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

    @abstractmethod
    def take_ops(self) -> list:
        """Drain and return the pending memory ops, in execution order."""

    def layout(self) -> CacheLayout:
        """The cache an executor must build to run this manager's plans (plain data; equal on
        every call). ConfigError for a policy whose plans no cache executes (reserve-*:
        simulator only)."""
        raise ConfigError(f"a cache needs a 'vmem' or 'paged' memory manager, got {self.name!r} "
                          f"(its plans are for the simulator only)")
