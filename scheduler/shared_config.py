"""The several-models simulator's configuration and results (shared_sim.py runs them):
``SharedConfig``, each field checked by name; ``ModelResult`` per model, ``SharedResult`` for
the device; ``SimulationStalledError`` when no lane can make progress any more."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import ConfigError, SchedulerError
from .field_checks import check_int
from .presets import get_device, get_model
from .report import RequestTiming
from .scheduler import SchedulerConfig
from .simulator import SimConfig

# Published A100 figures, per 2 MiB page (the CUDA VMM calls a vmem cache makes)
PAGE_CREATE_S = 193e-6        # cuMemCreate
PAGE_MAP_S = 1.45e-6          # cuMemMap
PAGE_SET_ACCESS_S = 36e-6     # cuMemSetAccess
PAGE_UNMAP_S = 26e-6          # cuMemUnmap
GROW_PAGE_S = PAGE_CREATE_S + PAGE_MAP_S + PAGE_SET_ACCESS_S   # a page taken into service
RELEASE_PAGE_S = PAGE_UNMAP_S                                  # a page given back
MAX_PAGE_S = 1.0              # a page's cost, at most (the A100's is 230 us)
MAX_IDLE_RELEASE_S = 1e8      # below MemoryBudget's own limit


class SimulationStalledError(SchedulerError, RuntimeError):
    """A several-models run in which no lane made progress (no arrival, no token, no request
    ended) for ``SharedSimulator.stall_turns`` turns: its message names each lane and what it
    waits for. A bug of the budget's rule, never a workload's."""


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def kv_bytes_after_weights(device: str, models: Sequence[str]) -> int:
    """The device's memory less every model's weights (bytes): the KV memory of all of them
    together. No headroom for activations or the CUDA context: an upper bound."""
    left = get_device(device).memory_bytes - sum(get_model(m).weight_bytes for m in models)
    if left <= 0:
        raise ConfigError(f"the weights of {', '.join(models)} do not fit {device}'s "
                          f"{get_device(device).memory_bytes} bytes")
    return left


@dataclass(frozen=True)
class SharedConfig:
    """One device shared by several models (one per workload, in the workloads' order)."""
    elastic: bool = True                  # a shared MemoryBudget; False: total / N each, fixed
    model: str = "llama-3-8b"             # every model's preset, unless ``models`` names each
    models: Tuple[str, ...] = ()
    device: str = "h100"
    total_bytes: Optional[int] = None     # KV bytes of all models; None: kv_bytes_after_weights
    min_fraction: float = 0.25            # elastic: each share's min_bytes, of total_bytes
    idle_release_s: float = 2.0           # elastic: simulated seconds idle before giving back
    grow_fraction: float = 0.125          # elastic: the least a grow asks, of max_bytes
    grow_page_s: float = GROW_PAGE_S      # seconds per page taken into service
    release_page_s: float = RELEASE_PAGE_S   # seconds per page given back
    page_bytes: int = 2 * 2**20
    layout: str = "interleaved"           # vmem layout (interleaved: no per-layer end waste)
    max_seq_len: int = 4096
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.elastic, bool):
            raise ConfigError(f"elastic must be True or False, got {self.elastic!r}")
        for name in ("min_fraction", "grow_fraction"):
            value = getattr(self, name)
            if not _real(value) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
        for name, most in (("idle_release_s", MAX_IDLE_RELEASE_S),
                           ("grow_page_s", MAX_PAGE_S), ("release_page_s", MAX_PAGE_S)):
            value = getattr(self, name)
            if not _real(value) or not 0 <= value <= most:
                raise ConfigError(f"{name} must be seconds in [0, {most:g}], got {value!r}")
        check_int("page_bytes", self.page_bytes, 1)   # 0 was a ZeroDivisionError in the run
        total, page = self.total_bytes, self.page_bytes
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < page):
            raise ConfigError(f"total_bytes must be None or an int of bytes >= page_bytes "
                              f"({self.page_bytes!r}: one page), got {total!r}")

    def model_names(self, count: int) -> Tuple[str, ...]:
        if not self.models:
            return (self.model,) * count
        if len(self.models) != count:
            raise ConfigError(f"models names {len(self.models)} presets for {count} workloads")
        return self.models

    def sim_config(self, model: str, cache_bytes: int) -> SimConfig:
        """The single-model config of one lane (its cost model, its scheduler config)."""
        return SimConfig(policy="vmem", model=model, device=self.device, cache_bytes=cache_bytes,
                         max_seq_len=self.max_seq_len, page_bytes=self.page_bytes,
                         layout=self.layout, scheduler=self.scheduler)


@dataclass
class ModelResult:
    """One model's run. Times in simulated seconds, memory in bytes."""
    name: str
    model: str
    num_requests: int
    output_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float     # output tokens / (its last token - its first arrival)
    num_preemptions: int
    final_cache_bytes: int
    peak_cache_bytes: int
    grows: int
    gives: int
    pages_created: int             # pages taken into service by growth
    pages_released: int            # pages given back (ReleasePages)
    resize_seconds: float          # the resizes' page cost, charged to its steps
    num_steps: int
    failed_requests: int = 0       # refused at arrival: longer than its pool has held (the
                                   # engine's 503), left out of the request count and latencies
    serving: Dict[str, float] = field(default_factory=dict, repr=False)
    timings: List[RequestTiming] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "timings"}


@dataclass
class SharedResult:
    """Every model's result and the device's: ``overall`` pools the requests of all."""
    elastic: bool
    total_bytes: int
    peak_held_bytes: int           # the most the models held at once (<= total_bytes, checked)
    models: Dict[str, ModelResult]
    overall: Dict[str, float]
    wall_seconds: float

    def to_dict(self) -> dict:
        return {"elastic": self.elastic, "total_bytes": self.total_bytes,
                "peak_held_bytes": self.peak_held_bytes, "overall": self.overall,
                "wall_seconds": self.wall_seconds,
                "models": {n: m.to_dict() for n, m in self.models.items()}}
