"""Scheduler metrics, named as vLLM users know them.

Gauges (running, waiting, swapped, kv_cache_usage_perc) are read live from the scheduler and its
manager; counters (num_preemptions, recomputed tokens, prefix cache queries/hits) and latency
samples (TTFT, inter-token latency, in whatever clock ``Scheduler.update`` is given: simulated
seconds in the simulator, wall seconds in the engine) accumulate here.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence


class SchedulerMetrics:
    """Counters and latency samples of one scheduler's lifetime."""

    __slots__ = ("num_preemptions", "num_swap_preemptions", "recomputed_tokens",
                 "num_finished_requests", "num_aborted_requests", "num_failed_requests",
                 "generated_tokens", "ttft_s", "itl_s")

    def __init__(self) -> None:
        self.num_preemptions = 0        # recompute + swap
        self.num_swap_preemptions = 0   # of which swap
        self.recomputed_tokens = 0      # cached tokens thrown away by recompute preemption
        self.num_finished_requests = 0
        self.num_aborted_requests = 0   # ended by abort_request(..., ABORTED)
        self.num_failed_requests = 0    # ended by abort_request(..., FAILED)
        self.generated_tokens = 0       # sampled tokens, all sequences
        self.ttft_s: List[float] = []   # per request: first token time - arrival
        self.itl_s: List[float] = []    # per token after a sequence's first: gap to previous


def gauges(scheduler) -> Dict[str, float]:
    """``Scheduler.gauges()``: vLLM-named live gauges and counters of a scheduler."""
    mgr = scheduler.manager
    return {
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "num_requests_swapped": len(scheduler.swapped),
        "kv_cache_usage_perc": mgr.kv_cache_usage(),     # cached-but-free units count as free
        "num_preemptions": scheduler.metrics.num_preemptions,
        "prefix_cache_queries": mgr.prefix_queries,      # tokens
        "prefix_cache_hits": mgr.prefix_hits,            # tokens
        "prefix_cache_hit_rate": prefix_hit_rate(mgr.prefix_hits, mgr.prefix_queries),
        "prefix_cache_cached_tokens": mgr.cached_tokens,  # held only by the prefix cache
    }


def prefix_hit_rate(hits: int, queries: int) -> float:
    """Hit tokens over queried tokens (vLLM's prefix cache hit rate); 0.0 before any query."""
    return hits / queries if queries else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    return sorted_percentile(sorted(values), q)


def sorted_percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted ``xs``, interpolated as numpy does by default."""
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_summary(name: str, values: Sequence[float]) -> Dict[str, float]:
    """``{name_mean_s, name_p50_s, name_p90_s, name_p99_s}`` of a latency sample in seconds."""
    xs = sorted(values)
    out = {f"{name}_mean_s": sum(xs) / len(xs) if xs else math.nan}
    for q in (50, 90, 99):
        out[f"{name}_p{q}_s"] = sorted_percentile(xs, q)
    return out
