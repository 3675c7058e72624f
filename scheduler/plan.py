"""The scheduler's configuration and the plan it hands the executor each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple, Union

from .errors import ConfigError
from .field_checks import check_int
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
    check_every_step: bool = False       # manager.check_integrity() after every update (tests;
                                         # idle steps always run its O(1) check_idle)
    max_seq_len: Optional[int] = None    # tokens; None = the manager's max_seq_len

    def __post_init__(self) -> None:
        """ConfigError naming ``SchedulerConfig.<field>``, the value and the allowed range: a
        bool is no count, a str no bool (``enable_prefix_sharing="no"`` turned sharing on)."""
        check_int("SchedulerConfig.max_running", self.max_running, 1)
        check_int("SchedulerConfig.max_tokens_per_step", self.max_tokens_per_step, 1)
        if self.max_tokens_per_step < self.max_running:
            raise ConfigError(f"SchedulerConfig.max_tokens_per_step must be an int >= "
                              f"max_running ({self.max_running}) so every decode fits a step, "
                              f"got {self.max_tokens_per_step!r}")
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ConfigError(f"SchedulerConfig.watermark must be a fraction in [0, 1), got {w!r}")
        if not isinstance(self.preemption, str) or self.preemption not in PREEMPTION_MODES:
            raise ConfigError(f"SchedulerConfig.preemption must be one of "
                              f"{', '.join(PREEMPTION_MODES)}, got {self.preemption!r}")
        for name in ("enable_prefix_sharing", "check_every_step"):
            _check_bool(f"SchedulerConfig.{name}", getattr(self, name))
        if self.max_seq_len is not None:    # None: the manager's
            check_int("SchedulerConfig.max_seq_len", self.max_seq_len, 1)

    def sequence_limit_tokens(self, manager_max_seq_len: int) -> int:
        """The tokens one sequence may hold: ``max_seq_len``, at most the manager's (None: the
        manager's). ConfigError past the manager's: its sequences cannot hold it (the config
        was taken, and every longer request refused saying the cache holds the manager's)."""
        if self.max_seq_len is None:
            return manager_max_seq_len
        if self.max_seq_len > manager_max_seq_len:
            raise ConfigError(f"SchedulerConfig.max_seq_len must be at most the manager's "
                              f"max_seq_len ({manager_max_seq_len} tokens a sequence), got "
                              f"{self.max_seq_len}")
        return self.max_seq_len


def _check_bool(field: str, value) -> None:
    """``value`` is True or False: a truthy str ("no") or 1 is not taken for one."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field} must be True or False, got {value!r}")


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
