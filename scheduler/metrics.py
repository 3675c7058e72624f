"""Scheduler metrics, named as vLLM users know them.

Gauges (running, waiting, swapped, kv_cache_usage_perc) are read live from the scheduler and its
manager; counters (num_preemptions, recomputed tokens, prefix cache queries/hits) and latency
samples (TTFT, inter-token latency, in whatever clock ``Scheduler.update`` is given: simulated
seconds in the simulator, wall seconds in the engine) accumulate here, in ``SampleLog``s: the
latest samples only, so an engine serving for weeks does not grow by 32 bytes a token.
"""
from __future__ import annotations

import math
from array import array
from typing import Dict, List, Sequence

SAMPLES_KEPT = 1_000_000   # a SampleLog keeps its latest 1-2 million samples: 8-16 MB


class SampleLog:
    """Samples (floats) in the order they came, the latest ``keep`` to ``2 * keep`` of them kept
    as 8-byte doubles (a list of floats takes 32 bytes a sample and never stops growing).
    Positions are absolute: ``end`` counts every sample ever appended, so a position taken
    before (a mark, a savepoint) still names the same samples after older ones were dropped.
    ``append`` and ``values.append`` (hot loops, followed by one ``trim()``) add samples."""

    __slots__ = ("values", "_start", "keep")

    def __init__(self, keep: int = SAMPLES_KEPT) -> None:
        if keep < 1:
            raise ValueError(f"SampleLog keeps at least 1 sample, got keep={keep!r}")
        self.values, self._start, self.keep = array("d"), 0, keep

    def append(self, value: float) -> None:
        self.values.append(value)
        self.trim()

    def trim(self) -> None:
        """Drop the oldest samples beyond the latest ``keep``, once twice that many are held."""
        if len(self.values) >= 2 * self.keep:
            excess = len(self.values) - self.keep
            del self.values[:excess]
            self._start += excess

    @property
    def end(self) -> int:
        """The position after the last sample: every sample ever appended."""
        return self._start + len(self.values)

    @property
    def dropped(self) -> int:
        """Samples dropped as older than the kept ones."""
        return self._start

    def since(self, position: int = 0) -> List[float]:
        """The kept samples from ``position`` on (those dropped since are not in it)."""
        return self.values[max(position - self._start, 0):].tolist()

    def truncate(self, position: int) -> None:
        """Forget the samples from ``position`` on (a rolled-back step's)."""
        del self.values[max(position - self._start, 0):]


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
        self.ttft_s = SampleLog()   # per request: first token time - arrival
        self.itl_s = SampleLog()    # per token after a sequence's first: gap to previous


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
        "prefix_cache_cached_tokens": mgr.cached_tokens,  # held only by the cache, each once
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
