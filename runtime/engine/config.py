"""EngineConfig: the cache, scheduling and backend choices of one Engine, validated up front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vmemkv.scheduler.geometry import LAYOUTS  # noqa: F401 (re-exported)

from .errors import EngineConfigError

CACHES = ("vmem", "paged")
PREEMPTION = ("recompute", "swap")


@dataclass(frozen=True)
class EngineConfig:
    """Every field is checked in ``__post_init__``; sizes are in tokens unless named ``_bytes``."""
    cache: str = "vmem"                  # "vmem" (contiguous per request) or "paged" (blocks)
    layout: str = "per-layer"            # vmem: "per-layer" or "interleaved" (all layers per page)
    page_bytes: Optional[int] = None     # vmem page size; None: 2 MiB on CUDA, 64 KiB-ish on host
    block_size: int = 16                 # paged: tokens per block
    max_batch: int = 8                   # sequences running at once (vmem: slots)
    max_context: int = 1024              # tokens per sequence, prompt + output (vmem: rounded
                                         # up to whole pages)
    cache_bytes: Optional[int] = None    # device bytes for K/V; None: max_batch full sequences
    max_tokens_per_step: int = 2048      # new tokens per step (prefill chunking budget)
    attention: Optional[str] = None      # backend name; None: fastest for the layout and device
    preemption: str = "recompute"        # when a running sequence cannot grow: recompute | swap
    swap_bytes: int = 0                  # host swap space for preemption="swap"
    watermark: float = 0.0               # fraction of the cache admission keeps free
    prefix_sharing: bool = False         # share cached prompt prefixes across requests (opt-in:
                                         # hashing every prompt costs time when nothing repeats)
    background_mapper: bool = False      # vmem: map pages on a thread, overlapping compute
    seed: int = 0                        # seeds the generators of requests without a seed
    check_integrity: bool = False        # run the manager's integrity check after every step
    max_plan_retries: int = 3            # a failed memory plan is retried this many times in a
                                         # row before generate() raises PlanExecutionError

    def __post_init__(self) -> None:
        self._one_of("cache", CACHES)
        self._one_of("layout", LAYOUTS)
        self._one_of("preemption", PREEMPTION)
        for name, low in (("block_size", 1), ("max_batch", 1), ("max_context", 2),
                          ("max_tokens_per_step", 1), ("swap_bytes", 0), ("seed", 0),
                          ("max_plan_retries", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise EngineConfigError(f"EngineConfig.{name} must be an int >= {low}, got {value!r}")
        for name in ("page_bytes", "cache_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EngineConfigError(f"EngineConfig.{name} must be an int >= 1 or None, got {value!r}")
        if self.max_tokens_per_step < self.max_batch:
            raise EngineConfigError(f"EngineConfig.max_tokens_per_step must be >= max_batch "
                                    f"({self.max_batch}) so every decode fits a step, got "
                                    f"{self.max_tokens_per_step}")
        if (not isinstance(self.watermark, (int, float)) or isinstance(self.watermark, bool)
                or not 0.0 <= self.watermark < 1.0):
            raise EngineConfigError(f"EngineConfig.watermark must be in [0, 1), got {self.watermark!r}")
        if self.preemption == "swap" and self.swap_bytes == 0:
            raise EngineConfigError("EngineConfig.swap_bytes must be > 0 when preemption='swap'")

    def _one_of(self, name: str, allowed: tuple) -> None:
        if getattr(self, name) not in allowed:
            raise EngineConfigError(f"EngineConfig.{name} must be one of {', '.join(allowed)}, "
                                    f"got {getattr(self, name)!r}")
