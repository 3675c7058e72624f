"""The scheduler's configuration and the plan it hands the executor each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple, Union

from .errors import ConfigError
from .managers.base import (CopyBlock, CopyExtent, DropSwapped, MapExtent, ReleasePages,  # noqa: F401
                            MemoryOp, SwapIn, SwapOut, UnmapExtent,  # the ops a plan carries
                            LoadAdapter, EvictAdapter)

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits; validated on construction."""
    max_running: int = 1024              # sequences in a step (vLLM max_num_seqs)
    max_tokens_per_step: int = 8192      # new tokens in a step (vLLM max_num_batched_tokens)
    watermark: float = 0.0               # fraction of total capacity admission keeps free
    preemption: str = "recompute"        # "recompute" (free, re-prefill) or "swap" (to host)
    enable_prefix_sharing: bool = False  # pass token ids to the manager to share prefixes
    check_every_step: bool = False       # manager.check_integrity() after every update (tests)
    max_seq_len: Optional[int] = None    # tokens; None = the manager's max_seq_len

    def __post_init__(self) -> None:
        if not isinstance(self.max_running, int) or self.max_running < 1:
            raise ConfigError(f"max_running must be an int >= 1, got {self.max_running!r}")
        if not isinstance(self.max_tokens_per_step, int) or self.max_tokens_per_step < self.max_running:
            raise ConfigError(f"max_tokens_per_step must be an int >= max_running "
                              f"({self.max_running}) so every decode fits a step, "
                              f"got {self.max_tokens_per_step!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ConfigError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption!r}")


class ScheduledSeq(NamedTuple):
    """One sequence's work in a step. Positions are token indices in the sequence."""
    seq_id: int
    num_computed_tokens: int      # tokens already cached = position of the first new token
    num_new_tokens: int           # tokens to compute this step
    new_token_ids: Optional[Tuple[int, ...]]  # their ids, when known (None: prompt ids unknown)
    sample: bool                  # this step yields a sampled token (decode or last prefill chunk)
    fork_ids: Tuple[int, ...] = ()  # n > 1: also sample one token for each of these children
    adapter_id: Optional[str] = None  # the LoRA adapter its rows run with (its digest); None: base


# ---- table edits: where each sequence's tokens live, as changes to the executor's replica ----
# An executor keeps a replica of the tables plans told it (vmem: seq -> slot; paged: seq ->
# block table) and applies these edits, in order, after the plan's memory ops and before its
# sequences run. An edit is sent only when the placement changed since the last one sent.

class SetSlot(NamedTuple):
    """vmem: sequence ``seq_id`` lives on slot ``slot`` from now on."""
    seq_id: int
    slot: int


class EditBlocks(NamedTuple):
    """paged: the block table of ``seq_id`` in block group ``group`` (0 but for hybrids, one
    table per group: ``CacheLayout.block_groups``) becomes ``table[:keep] + append``."""
    seq_id: int
    keep: int
    append: Tuple[int, ...]
    group: int = 0


class DropTable(NamedTuple):
    """Forget the placement of ``seq_id`` (finished, preempted or swapped out)."""
    seq_id: int


TableEdit = Union[SetSlot, EditBlocks, DropTable]


@dataclass
class StepPlan:
    """Everything the executor needs for one step; plain data, picklable, no live objects.

    Execute ``ops`` in order, then apply ``tables`` to the executor's replica, then run
    ``seqs``. ``tables`` is filled only when the scheduler has a table tracker (a real cache
    needs it; the simulator does not)."""
    seqs: List[ScheduledSeq]
    ops: list                                              # manager.take_ops()
    preempted: List[int] = field(default_factory=list)     # preempted this step (both modes)
    swapped_out: List[int] = field(default_factory=list)   # of which swapped to host
    finished: List[int] = field(default_factory=list)      # finished by the previous update
    num_new_tokens: int = 0        # sum of num_new_tokens
    num_context_tokens: int = 0    # sum of num_computed_tokens + num_new_tokens (KV read)
    tables: List[TableEdit] = field(default_factory=list)  # replica edits, see SetSlot/EditBlocks

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.ops and not self.tables
