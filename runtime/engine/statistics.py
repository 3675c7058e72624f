"""The engine's statistics: marks taken before a ``generate``, and ``EngineStats`` since one.

A mixin of ``Engine``: it reads the engine's counters (steps, step time and its phases, the
scheduler's metrics, the manager's prefix counters, the cache's mapping times) and never
changes them.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.managers.base import AdapterStats
from vmemkv.scheduler.report import serving_report

from .call_checks import check_list_of
from .errors import EngineConfigError
from .outputs import EngineStats, RequestOutput, TokenEvent, request_timings


class StatsMark(dict):
    """The engine's counters at one moment, which ``stats(since=mark)`` counts from (taken by
    ``generate``, ``stream`` and ``beam_search``); a dict of another kind is refused by name."""


class EngineStatistics:
    """``stats(since=mark)`` and the marks ``generate``/``stream`` take (see ``Engine``)."""

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _mark(self) -> StatsMark:
        m = self.scheduler.metrics
        return StatsMark(t=time.perf_counter(), steps=self._steps, step_s=self._step_s,
                         mapping_s=self.kv.cache.mapping_s,
                         mapping_stall_s=self.kv.cache.mapping_stall_s, kv=self._kv_usage.end,
                         pre=m.num_preemptions, swap=m.num_swap_preemptions,
                         rec=m.recomputed_tokens,
                         ttft=m.ttft_s.end, itl=m.itl_s.end, gen=m.generated_tokens,
                         done=m.num_finished_requests, prompt=self._prompt_tokens,
                         computed=self._computed_tokens, pq=self.kv.manager.prefix_queries,
                         ph=self.kv.manager.prefix_hits, phases=self._phases(),
                         lora=self.kv.manager.adapter_stats())

    def _phases(self) -> dict:
        return {**self._phase_s, **self.runner.phase_s}

    def _count_finished(self, events: Sequence[TokenEvent]) -> None:
        """Add the prompt tokens of each request a step's ``events`` finished, once (n samples,
        beams): ``prompt_tokens`` counts the requests ``requests`` counts, the scheduler's
        finished ones (an aborted or failed request's prompt is in neither). Called while the
        step is recorded, so a step undone takes its count back (``RecordingSavepoint``)."""
        for rid in {event.request_id for event in events if event.finished}:
            output = self._requests[rid].output
            if output.status == "finished":
                self._prompt_tokens += len(output.prompt_token_ids)

    def stats(self, since: Optional[StatsMark] = None,
              outputs: Sequence[RequestOutput] = ()) -> EngineStats:
        """Statistics since ``since`` (a mark taken by generate/stream), or since creation;
        ``serving`` is the serving report of those of ``outputs`` that finished (wall seconds;
        empty without outputs): an aborted or failed request is not "completed" and its
        latencies are not counted (as ``requests`` and ``prompt_tokens``; vLLM's benchmark
        counts only successful requests). Latency samples and K/V usage are the kept ones
        (``SampleLog``: the latest 1-2 million; a long-lived engine's oldest are dropped),
        counters are exact. EngineConfigError naming the argument for a ``since`` that is no
        mark (a dict was a KeyError) or ``outputs`` that are not RequestOutputs."""
        if since is not None and not isinstance(since, StatsMark):
            raise EngineConfigError(f"stats: since must be None or a StatsMark (taken by "
                                    f"generate/stream), got {type(since).__name__} "
                                    f"{repr(since)[:60]}")
        check_list_of("stats: outputs", outputs, RequestOutput, "as generate returns them")
        b = since or dict(t=self._t0, steps=0, step_s=0.0, mapping_s=0.0, mapping_stall_s=0.0, kv=0, pre=0,
                          swap=0, rec=0, ttft=0, itl=0, gen=0, done=0, prompt=0, computed=0,
                          pq=0, ph=0, phases={}, lora=AdapterStats())
        m, usage = self.scheduler.metrics, self._kv_usage.since(b["kv"])
        lora = self.kv.manager.adapter_stats()
        phases = {f"{k}_s": v - b["phases"].get(k, 0.0) for k, v in self._phases().items()}
        return EngineStats(
            cache=(self.config.cache if self.kv.cache.kind is CacheKind.PAGED
                   else f"vmem/{self.config.layout}"),
            attention=self.attention, requests=m.num_finished_requests - b["done"],
            prompt_tokens=self._prompt_tokens - b["prompt"], output_tokens=m.generated_tokens - b["gen"],
            steps=self._steps - b["steps"], wall_s=time.perf_counter() - b["t"],
            step_s=self._step_s - b["step_s"], mapping_s=self.kv.cache.mapping_s - b["mapping_s"],
            mapping_stall_s=self.kv.cache.mapping_stall_s - b["mapping_stall_s"],
            num_preemptions=m.num_preemptions - b["pre"], num_swap_preemptions=m.num_swap_preemptions - b["swap"],
            recomputed_tokens=m.recomputed_tokens - b["rec"],
            kv_usage_mean=sum(usage) / len(usage) if usage else 0.0, kv_usage_peak=max(usage, default=0.0),
            cache_bytes=self._pool_bytes(),
            computed_tokens=self._computed_tokens - b["computed"],
            prefix_cache_queries=self.kv.manager.prefix_queries - b["pq"],
            prefix_cache_hits=self.kv.manager.prefix_hits - b["ph"],
            lora_adapter_loads=lora.loads - b["lora"].loads,
            lora_adapter_evictions=lora.evictions - b["lora"].evictions,
            lora_adapter_pages=lora.pages,
            ttft_s=m.ttft_s.since(b["ttft"]), itl_s=m.itl_s.since(b["itl"]),
            serving=serving_report(request_timings([o for o in outputs if o.status == "finished"]))
            if outputs else {}, **phases)

    def _pool_bytes(self) -> int:
        """The pool's bytes as its stats count them (a paged hybrid's: block-group tokens at a
        group's bytes; it was counted at a whole token's, the layers over)."""
        stats = self.kv.manager.stats()
        return stats.total_tokens * stats.bytes_per_token

    @property
    def tp_comm_s(self) -> float:
        """Seconds rank 0 spent in tensor-parallel collectives so far (0 without TP)."""
        return self.tp.comm_s if self.tp is not None else 0.0
