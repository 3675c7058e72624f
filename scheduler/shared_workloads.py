"""Workloads for several models sharing one device (shared_sim.py runs them): per model a
Poisson process that alternates bursts and quiet phases, the models out of phase, or real
traces replayed each a little later than the one before.

    lanes = bursty_workload(BurstySpec(duration_s=120))            # {"a": [...], "b": [...]}
    lanes = shifted_traces({"a": "azure-code", "b": "azure-conv"}, shift_s=30)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import ConfigError
from .traces import fit_to_length, load_trace
from .workload import TraceEntry, WorkloadSpec, generate


@dataclass(frozen=True)
class BurstySpec:
    """Per model a Poisson process whose rate alternates between a burst and a quiet phase,
    the models' bursts evenly out of phase (two models: A bursts while B is quiet). Lengths
    are ``lengths``' (the standard workload's distributions by default)."""
    models: Tuple[str, ...] = ("a", "b")
    duration_s: float = 120.0             # arrivals in [0, duration_s)
    period_s: float = 60.0                # one burst and one quiet phase
    burst_fraction: float = 0.5           # of each period, bursting
    burst_rate: float = 40.0              # requests/s while bursting
    quiet_rate: float = 2.0               # requests/s while quiet (0: idle)
    seed: int = 0
    lengths: WorkloadSpec = field(default_factory=WorkloadSpec)   # its count/rate/seed unused

    def __post_init__(self) -> None:
        if not self.models or len(set(self.models)) != len(self.models):
            raise ConfigError(f"BurstySpec.models must be distinct names, got {self.models!r}")
        if not (self.duration_s > 0 and self.period_s > 0):
            raise ConfigError(f"BurstySpec duration_s and period_s must be > 0, got "
                              f"{self.duration_s!r}, {self.period_s!r}")
        if not 0 < self.burst_fraction <= 1:
            raise ConfigError(f"BurstySpec.burst_fraction must be in (0, 1], got "
                              f"{self.burst_fraction!r}")
        if not (self.burst_rate >= 0 and self.quiet_rate >= 0):
            raise ConfigError(f"BurstySpec rates must be >= 0 requests/s, got "
                              f"{self.burst_rate!r}, {self.quiet_rate!r}")

    def phases(self, k: int) -> List[Tuple[float, float, float]]:
        """Model ``k``'s (start, end, rate) segments covering [0, duration_s): its bursts
        start at k * period / models, modulo the period."""
        burst = self.burst_fraction * self.period_s
        offset = (k * self.period_s / len(self.models)) % self.period_s
        start = offset - self.period_s if offset > 0 else 0.0
        out = []
        while start < self.duration_s:
            for a, b, rate in ((start, start + burst, self.burst_rate),
                               (start + burst, start + self.period_s, self.quiet_rate)):
                a, b = max(a, 0.0), min(b, self.duration_s)
                if b > a:
                    out.append((a, b, rate))
            start += self.period_s
        return out


def bursty_workload(spec: BurstySpec) -> Dict[str, List[TraceEntry]]:
    """{model name: entries} of ``spec``, seeded: model k draws from
    ``numpy.random.default_rng([seed, k])`` a Poisson count per segment and its arrivals
    uniform in it (a Poisson process of that rate), then the seed of its lengths, drawn as
    ``workload.generate`` draws the standard workload's."""
    import numpy as np
    out = {}
    for k, name in enumerate(spec.models):
        rng = np.random.default_rng([spec.seed, k])
        arrivals: List[float] = []
        for a, b, rate in spec.phases(k):
            count = int(rng.poisson(rate * (b - a)))
            arrivals += sorted(rng.uniform(a, b, count).tolist())
        seed = int(rng.integers(2**31))
        if not arrivals:
            out[name] = []
            continue
        lengths = generate(replace(spec.lengths, num_requests=len(arrivals), arrival_rate=0.0,
                                   seed=seed))
        out[name] = [replace(e, arrival_s=t) for e, t in zip(lengths, arrivals)]
    return out


def shifted_traces(traces: Mapping[str, str], shift_s: float, *, max_requests: Optional[int]
                   = None, rate_scale: float = 1.0, max_total_len: int = 4096
                   ) -> Dict[str, List[TraceEntry]]:
    """{model name: entries} replaying ``traces`` ({model name: bundled trace or path}), the
    k-th shifted ``k * shift_s`` seconds later; lengths fitted to ``max_total_len``."""
    out = {}
    for k, (name, trace) in enumerate(traces.items()):
        entries, _ = fit_to_length(load_trace(trace, rate_scale=rate_scale,
                                              max_requests=max_requests), max_total_len)
        out[name] = [replace(e, arrival_s=e.arrival_s + k * shift_s) for e in entries]
    return out
