"""The memory operations a manager plans: plain, picklable data an executor applies in order
(the runtime cache on real memory) or counts (the simulator). ``base.py`` re-exports them with
the interface; ``MemoryOp`` is any of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


# ---- memory operations -------------------------------------------------------------------
# vmem mode. A "page group" is the manager's unit: one run of tokens_per_page tokens of one
# slot across every layer's K and V (scheduler.geometry). The manager decides which POOL PAGES
# back it, from one PageLedger (ledger.py), per layer KIND (a uniform model has one kind; a
# hybrid one in the per-layer layout has "full" and "window-W"), and names them in the ops:
# the executor only maps "range page <- named pool page", the same on every rank.
#
#   member j of kind K (its layers' K/V, in layer order), member page i (0..k-1) of the page
#   index pi under slot s  <-  MapExtent.pool_pages[(i - first_page) * members(K) + j]
#
# A kind's extent at (slot, page_index) is mapped from member page 0 up: a MapExtent with
# first_page > 0 extends it (a byte-mapped group whose bytes grew), an UnmapExtent with
# first_page > 0 shrinks it. Giving pages back is ledger bookkeeping in the manager: no op.

# ``owner``: the seq id of the one sequence an op serves, None for a reclaiming op (blame,
# docs/ARCHITECTURE.md). No op serves several: a shared group is mapped once per holder slot,
# a shared partial unit copied for its one writer. Ops compare equal by the memory they touch
# (compare=False); a reclaiming op's owner is a class constant (nothing in the pickle).

@dataclass(frozen=True)
class MapExtent:
    """Map ``pool_pages`` under ``slot`` at ``page_index`` (tokens [page_index *
    tokens_per_page, (page_index + 1) * tokens_per_page)) for the members of layer kind
    ``kind``: member pages ``first_page`` on, one pool page per member per member page, in
    member order (see the diagram above). Nothing of that kind may be mapped there at or past
    ``first_page``, and everything before it must be."""
    slot: int
    page_index: int
    kind: str
    pool_pages: tuple
    first_page: int = 0
    owner: Optional[int] = field(default=None, compare=False)  # the seq served


@dataclass(frozen=True)
class UnmapExtent:
    """Unmap kind ``kind``'s member pages ``first_page`` on (all of them mapped there) under
    ``slot`` at ``page_index``; the pool pages stay the manager's to reuse."""
    slot: int
    page_index: int
    kind: str
    first_page: int = 0
    owner = None      # reclaiming: serves whoever takes the memory next (not a field)


@dataclass(frozen=True)
class CopyExtent:
    """Copy the bytes of kind ``kind``'s extent mapped at one (slot, page_index) into the one
    mapped at another: every mapped member page of the source (copy-on-write of a shared
    partial page group; the destination is mapped at least as far), or, with ``num_tokens``,
    each member's bytes of tokens [0, num_tokens) (a block-granular prefix hit; both mapped as
    far as those bytes). One op per kind. ``member_pages``: for the former, the member pages
    the manager has the source mapped with (what the copy moves, for the simulator's charge;
    the executor refuses the op when its replica says otherwise)."""
    src_slot: int
    src_page_index: int
    dst_slot: int
    dst_page_index: int
    kind: str
    owner: Optional[int] = field(default=None, compare=False)  # the seq served
    num_tokens: Optional[int] = None    # None: the whole mapped extent
    member_pages: Optional[int] = field(default=None, compare=False)   # None: not said


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


@dataclass(frozen=True)
class ReleasePages:
    """Give the physical memory of ``pool_pages`` (mapped nowhere) back to the device: the
    pool shrank (``MemoryManager.resize``). A page taken back into service needs no op: the
    executor creates its memory again when a MapExtent next names it."""
    pool_pages: tuple
    owner = None      # reclaiming (not a field)


# LoRA adapters (scheduler/adapters.py): weights held in the pool KV uses, tenant ("adapter",
# digest) of the same ledger. vmem: pool pages; paged: blocks (the bytes then live in a buffer
# of their own, the blocks are their share of the block budget).

@dataclass(frozen=True)
class LoadAdapter:
    """Make ``num_bytes`` of memory for adapter ``adapter_id`` (its digest) over
    ``pool_pages``, in order: byte b lies in ``pool_pages[b // unit]`` (vmem: a page; paged: a
    block's bytes, ``MemoryManager.adapter_pages``). The pages were mapped nowhere once the
    plan's earlier ops ran; the executor maps them (vmem) and the caller writes the weights in
    after the plan (``adapter_buffer``)."""
    adapter_id: str
    pool_pages: tuple
    num_bytes: int
    owner: Optional[int] = field(default=None, compare=False)  # the seq that needed it


@dataclass(frozen=True)
class EvictAdapter:
    """Forget adapter ``adapter_id``'s memory: ``pool_pages`` go back to the pool (its weights
    are lost; a later LoadAdapter writes them again)."""
    adapter_id: str
    pool_pages: tuple
    owner = None      # reclaiming (not a field)


MemoryOp = Union[MapExtent, UnmapExtent, CopyExtent, CopyBlock, SwapOut, SwapIn, DropSwapped,
                 ReleasePages, LoadAdapter, EvictAdapter]
