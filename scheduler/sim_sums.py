"""The simulator's figures summed over steps: per-step memory figures, LoRA adapters, swaps.

``StepSums`` keeps sums over steps of what ``SimResult`` reports as means; ``AdapterSums`` the
adapter figures a LoRA run reads from its plans' ops; ``SwapSums`` the bytes swap preemption
moves between host and device and the seconds they are charged. Each ``step`` (``add``) sees
one step; ``figures`` / ``means`` give the result's fields.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from .managers.base import EvictAdapter, LoadAdapter, MemoryManager, check_stats
from .workload import TraceEntry


class StepSums:
    """Sums over steps of the per-step figures SimResult reports as means."""

    __slots__ = ("steps", "batch", "util", "held", "usage", "waste", "seconds", "tokens",
                 "util_steps", "held_steps")

    def __init__(self) -> None:
        self.steps = self.batch = self.tokens = self.util_steps = self.held_steps = 0
        self.util = self.held = self.usage = self.waste = self.seconds = 0.0

    def add(self, batch: int, figures: tuple, seconds: float, tokens: int) -> None:
        util, held, usage, waste = figures
        self.steps += 1
        self.batch += batch
        if util is not None:          # a step that allocated nothing has no utilisation
            self.util += util
            self.util_steps += 1
        if held is not None:          # nor one that ended holding nothing a held one
            self.held += held
            self.held_steps += 1
        self.usage += usage
        self.waste += waste
        self.seconds += seconds
        self.tokens += tokens

    def means(self) -> Dict[str, Optional[float]]:
        """Per-step means, and output tokens per second of these steps' time; every figure
        None when there was no step (a mean of nothing is absent, not 0)."""
        if not self.steps:
            return dict.fromkeys(("mean_batch", "kv_utilization", "held_utilization",
                                  "kv_cache_usage_perc", "mean_end_waste_tokens",
                                  "output_tokens_per_s"))
        div = self.steps
        return {"mean_batch": self.batch / div,
                "kv_utilization": self.util / self.util_steps if self.util_steps else None,
                "held_utilization": self.held / self.held_steps if self.held_steps else None,
                "kv_cache_usage_perc": self.usage / div,
                "mean_end_waste_tokens": self.waste / div,
                "output_tokens_per_s": self.tokens / self.seconds if self.seconds else None}


def step_figures(manager: MemoryManager, running: int) -> tuple:
    """(utilisation, held utilisation, usage, end waste per running sequence) of one step,
    the first two None where nothing is allocated / held (a step whose sequences all finished:
    a vacuous 1.0 there made a trace of one-token outputs read 100% held utilisation);
    usage is vLLM's kv_cache_usage_perc (``manager.kv_cache_usage()``: cached, evictable
    memory counts as free, as the engine's metrics count it). ManagerContractError naming
    the policy when its ``stats()`` or usage is impossible (``check_stats``: a user's policy's
    impossible figures are refused, never averaged)."""
    stats, usage = manager.stats(), manager.kv_cache_usage()
    check_stats(manager, stats, usage)
    held = stats.live_tokens + stats.end_waste_tokens
    # waste in whole tokens (every layer's bytes): a paged hybrid's stats count block-group
    # tokens, one per group, which read as tokens were the groups' count times too many
    waste = stats.end_waste_tokens * stats.bytes_per_token / manager.bytes_per_token
    return (stats.live_tokens / stats.allocated_tokens if stats.allocated_tokens else None,
            stats.live_tokens / held if held else None,
            usage,
            waste / running if running else 0.0)


class AdapterSums:
    """A LoRA run's adapter figures, from the plans' ops: loads and evictions, what is resident
    after each step (loaded and not evicted), the distinct adapters each step computes; and the
    seconds each step pays for them (``step``)."""

    def __init__(self, entries: Sequence[TraceEntry]) -> None:
        self.bytes_of = {e.adapter.digest: e.adapter.num_bytes for e in entries
                         if e.adapter is not None}
        self.resident: Dict[str, int] = {}      # adapter id -> pool pages it holds
        self.pages = self.loads = self.evictions = self.load_bytes = 0
        self.load_s = self.read_s = 0.0
        self.steps = self.sum_resident = self.sum_pages = self.sum_batched = 0
        self.peak_resident = self.peak_pages = 0

    def step(self, plan, h2d_bytes_per_s: float, read_bytes_per_s: Optional[float]) -> float:
        """Account one plan; returns the seconds its adapter loads and reads add to the step."""
        seconds = 0.0
        for op in plan.ops:
            kind = type(op)
            if kind is LoadAdapter:
                self.loads += 1
                self.load_bytes += op.num_bytes
                seconds += op.num_bytes / h2d_bytes_per_s
                self.resident[op.adapter_id] = len(op.pool_pages)
                self.pages += len(op.pool_pages)
            elif kind is EvictAdapter:
                self.evictions += 1
                self.pages -= self.resident.pop(op.adapter_id, 0)
        self.load_s += seconds
        batched = {s.adapter_id for s in plan.seqs} - {None}
        if batched and read_bytes_per_s:
            read = sum(self.bytes_of.get(a, 0) for a in batched) / read_bytes_per_s
            self.read_s += read
            seconds += read
        self.steps += 1
        self.sum_batched += len(batched)
        self.sum_resident += len(self.resident)
        self.sum_pages += self.pages
        self.peak_resident = max(self.peak_resident, len(self.resident))
        self.peak_pages = max(self.peak_pages, self.pages)
        return seconds

    def figures(self) -> Dict[str, float]:
        div = max(self.steps, 1)
        return dict(adapter_loads=self.loads, adapter_evictions=self.evictions,
                    adapter_load_bytes=self.load_bytes, adapter_load_seconds=self.load_s,
                    adapter_read_seconds=self.read_s,
                    mean_adapters_resident=self.sum_resident / div,
                    peak_adapters_resident=self.peak_resident,
                    mean_adapter_pages=self.sum_pages / div, peak_adapter_pages=self.peak_pages,
                    mean_step_adapters=self.sum_batched / div)
