"""Workloads for several models sharing one device (shared_sim.py runs them): per model a
Poisson process that alternates bursts and quiet phases, the models out of phase, or real
traces replayed each a little later than the one before.

    lanes = bursty_workload(BurstySpec(duration_s=120))            # {"a": [...], "b": [...]}
    lanes = shifted_traces({"a": "azure-code", "b": "azure-conv"}, shift_s=30)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import ConfigError
from .sim_memory import check_workload_fits
from .traces import fit_to_length, load_trace
from .workload import MAX_ARRIVAL_S, TraceEntry, WorkloadSpec, check_arrivals, generate

MAX_PERIODS = 100_000          # burst + quiet cycles in duration_s (each a segment per model)
MAX_ARRIVALS = 10_000_000      # expected arrivals of every model together


def _seconds(owner: str, name: str, value, positive: bool = True) -> float:
    """``value`` as finite seconds (> 0, or >= 0), else ConfigError naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not (value > 0 if positive else value >= 0):
        raise ConfigError(f"{owner}.{name} must be finite seconds {'> 0' if positive else '>= 0'}"
                          f", got {value!r}")
    return value


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
        if not isinstance(self.models, tuple) or not self.models or \
                len(set(self.models)) != len(self.models) or \
                not all(isinstance(m, str) and m for m in self.models):
            raise ConfigError(f"BurstySpec.models must be a tuple of distinct names, got "
                              f"{self.models!r}")
        _seconds("BurstySpec", "duration_s", self.duration_s)
        _seconds("BurstySpec", "period_s", self.period_s)
        if self.duration_s > MAX_ARRIVAL_S:
            raise ConfigError(f"BurstySpec.duration_s must be <= {MAX_ARRIVAL_S:.0e} s, got "
                              f"{self.duration_s!r}")
        if self.duration_s / self.period_s > MAX_PERIODS:
            raise ConfigError(f"BurstySpec.period_s={self.period_s!r} makes "
                              f"{self.duration_s / self.period_s:.3g} periods in duration_s="
                              f"{self.duration_s!r}; at most {MAX_PERIODS:,}")
        fraction = self.burst_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
                not 0 < fraction <= 1:
            raise ConfigError(f"BurstySpec.burst_fraction must be in (0, 1], got {fraction!r}")
        for name in ("burst_rate", "quiet_rate"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or \
                    not 0 <= rate < math.inf:
                raise ConfigError(f"BurstySpec.{name} must be finite requests/s >= 0, got "
                                  f"{rate!r}")
        expected = len(self.models) * self.duration_s * max(self.burst_rate, self.quiet_rate)
        if expected > MAX_ARRIVALS:
            raise ConfigError(f"BurstySpec: burst_rate={self.burst_rate!r}, quiet_rate="
                              f"{self.quiet_rate!r} over duration_s={self.duration_s!r} for "
                              f"{len(self.models)} models may draw {expected:.3g} arrivals; at "
                              f"most {MAX_ARRIVALS:,}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"BurstySpec.seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.lengths, WorkloadSpec):
            raise ConfigError(f"BurstySpec.lengths must be a WorkloadSpec, got "
                              f"{type(self.lengths).__name__}")

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
    expected = len(spec.models) * spec.duration_s * max(spec.burst_rate, spec.quiet_rate)
    check_workload_fits(int(expected), "draw fewer arrivals (duration_s, burst_rate)")
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
    k-th shifted ``k * shift_s`` seconds later (finite, >= 0); lengths fitted to
    ``max_total_len``. A lane whose last arrival, shifted, passes ``MAX_ARRIVAL_S`` is refused
    naming it (it was returned, and only ``simulate_shared`` refused it)."""
    if not isinstance(traces, Mapping):
        raise ConfigError(f"shifted_traces: traces must map each model's name to its trace, "
                          f"got {type(traces).__name__}")
    _seconds("shifted_traces", "shift_s", shift_s, positive=False)
    if shift_s * max(0, len(traces) - 1) > MAX_ARRIVAL_S:
        raise ConfigError(f"shifted_traces.shift_s={shift_s!r} shifts the last of {len(traces)} "
                          f"traces past {MAX_ARRIVAL_S:.0e} s")
    out = {}
    for k, (name, trace) in enumerate(traces.items()):
        entries, _ = fit_to_length(load_trace(trace, rate_scale=rate_scale,
                                              max_requests=max_requests), max_total_len)
        out[name] = [replace(e, arrival_s=e.arrival_s + k * shift_s) for e in entries]
        check_arrivals(out[name], f"shifted_traces: lane {name!r} ({trace} shifted "
                                  f"{k * shift_s:g} s)")
    return out
