"""``GET /metrics``: the server's figures in the Prometheus text format, with vLLM's names under
a ``vmemkv:`` prefix (``vllm:num_requests_running`` is ``vmemkv:num_requests_running``).

Gauges come from ``Scheduler.gauges()`` after every step and command, with the engine's
``kv_cache_bytes`` and ``is_sleeping`` (0/1; ours: vLLM has no such gauges); counters and the
TTFT / TPOT / E2E histograms are observed on the server's clock when a request ends (TTFT:
first token - arrival at the HTTP handler; E2E: last token - arrival; TPOT per sample with
more than one token). ``request_success_total`` carries vLLM's ``finished_reason`` label,
"stop" or "length" (``finished_reason``), each series shown from the start at 0; a request
counts once whatever its ``n`` (vLLM counts each sample), and aborted and failed requests in
their own counters (``num_failed_requests``: whether the engine failed the request alone, a 400
or a 500 to its client, or with every live request when a step raised; its HELP says which).
Thread-safe: the engine thread observes, HTTP handlers render.
"""
from __future__ import annotations

import bisect
import threading
from typing import Dict, List, Sequence, Tuple

from vmemkv.scheduler.report import RequestTiming

PREFIX = "vmemkv:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket bounds (seconds) for each histogram
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0)

GAUGES = {   # Scheduler.gauges() key -> (kind, help)
    "num_requests_running": ("gauge", "Sequences in model execution batches (each sample or beam once)."),
    "num_requests_waiting": ("gauge", "Sequences waiting to be processed (each sample or beam once)."),
    "num_requests_swapped": ("gauge", "Sequences swapped out to host memory (each sample or beam once)."),
    "kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "kv_cache_bytes": ("gauge", "Bytes of device memory the KV cache may use now (POST /resize)."),
    "is_sleeping": ("gauge", "1 while the engine is asleep (POST /sleep), else 0."),
    "num_preemptions": ("counter", "Cumulative number of preemptions."),
    "lora_adapters_loaded": ("gauge", "LoRA adapters loaded by name (POST /v1/load_lora_adapter)."),
    "lora_adapters_resident": ("gauge", "LoRA adapters whose weights are in the KV pool now."),
    "lora_adapter_pages": ("gauge", "Pool pages (vmem) or blocks (paged) adapter weights hold."),
    "lora_adapter_loads": ("counter", "Adapter weights written into the pool (loads)."),
    "lora_adapter_evictions": ("counter", "Idle adapters evicted from the pool for KV."),
    "prefix_cache_queries": ("counter", "Prefix-cache queries, in tokens."),
    "prefix_cache_hits": ("counter", "Prefix-cache hits, in tokens."),
}
SUCCESS = "request_success"
SUCCESS_HELP = ("Requests that finished, by finished_reason: stop (a stop token or string ended "
                "every sample) or length (a sample reached max_tokens).")
FINISHED_REASONS = ("stop", "length")   # the finished_reason values a finished request takes
COUNTERS = {
    "num_aborted_requests": "Requests aborted (a client disconnected, or the server stopped).",
    "num_failed_requests": ("Requests that ended failed: failed alone by the engine, for their own "
                            "parameters (a 400 naming the field: every score -inf after penalties "
                            "and logit_bias, or a request the KV cache can never hold) or because "
                            "their memory plans, forward or sampling kept failing (a 500), or with "
                            "every live request when a step raised that no request could be "
                            "blamed for (a 500)."),
    "prompt_tokens": "Prompt tokens of ended requests.",
    "generation_tokens": "Generated tokens of ended requests.",
}
STATUS_COUNTER = {"aborted": "num_aborted_requests", "failed": "num_failed_requests"}


def finished_reason(sample_reasons: Sequence[str]) -> str:
    """A finished request's ``finished_reason`` from its samples' finish reasons: "length" when
    any sample reached max_tokens (the answer was cut), else "stop"."""
    return "length" if "length" in sample_reasons else "stop"


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus reads them."""

    def __init__(self, name: str, help_: str, bounds_s: Sequence[float]) -> None:
        self.name, self.help, self.bounds = name, help_, tuple(bounds_s)
        self.counts = [0] * (len(self.bounds) + 1)   # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> List[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        lines += [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {self.count}"]
        return lines


class ServeMetrics:
    """The figures ``/metrics`` shows for one served model."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self._gauges: Dict[str, float] = {}
        self._successes = {reason: 0 for reason in FINISHED_REASONS}
        self._counters = {name: 0 for name in COUNTERS}
        self._histograms = {
            "ttft": Histogram("time_to_first_token_seconds", "Time to first token in seconds.",
                              TTFT_BUCKETS_S),
            "tpot": Histogram("time_per_output_token_seconds", "Time per output token in seconds.",
                              TPOT_BUCKETS_S),
            "e2e": Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS_S)}

    def set_gauges(self, gauges: Dict[str, float]) -> None:
        with self._lock:
            self._gauges = {k: v for k, v in gauges.items() if k in GAUGES}

    def observe_request(self, arrival_s: float, token_times_s: Dict[int, List[float]],
                        prompt_tokens: int, status: str, sample_reasons: Sequence[str]) -> None:
        """Count an ended request (finished: under ``finished_reason(sample_reasons)``, its
        samples' finish reasons); its latencies go into the histograms when it finished."""
        samples = [RequestTiming(arrival_s, tuple(times), prompt_tokens)
                   for times in token_times_s.values() if times]
        with self._lock:
            if status == "finished":
                self._successes[finished_reason(sample_reasons)] += 1
            else:
                self._counters[STATUS_COUNTER[status]] += 1
            self._counters["prompt_tokens"] += prompt_tokens
            self._counters["generation_tokens"] += sum(s.output_tokens for s in samples)
            if status != "finished" or not samples:
                return
            self._histograms["ttft"].observe(min(s.ttft_s for s in samples))
            self._histograms["e2e"].observe(max(s.e2el_s for s in samples))
            for s in samples:
                if s.tpot_s is not None:
                    self._histograms["tpot"].observe(s.tpot_s)

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        with self._lock:
            lines: List[str] = []
            for key, value in self._gauges.items():
                kind, help_ = GAUGES[key]
                lines += _family(key + ("_total" if kind == "counter" else ""), kind, help_,
                                 [(self.labels, value)])
            lines += _family(SUCCESS + "_total", "counter", SUCCESS_HELP,
                             [(f'{self.labels},finished_reason="{reason}"', n)
                              for reason, n in self._successes.items()])
            for key, value in self._counters.items():
                lines += _family(key + "_total", "counter", COUNTERS[key], [(self.labels, value)])
            for histogram in self._histograms.values():
                lines += histogram.render(self.labels)
        return "\n".join(lines) + "\n"


def _family(key: str, kind: str, help_: str, series: List[Tuple[str, float]]) -> List[str]:
    """One metric's HELP and TYPE lines and a sample per (labels, value) of ``series``."""
    name = PREFIX + key
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + \
        [f"{name}{{{labels}}} {float(value)!r}" for labels, value in series]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
