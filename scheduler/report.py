"""The serving report: what ``vllm bench serve`` reports, with its names, from per-request times.

One implementation for the simulator (simulated seconds), the engine (``vmemkv bench``, wall
seconds) and ``vmemkv bench serve`` (client-side wall seconds), so their figures compare.

Definitions (vLLM's ``benchmark_serving``; goodput as DistServe defines it):

- ``request_throughput``: completed requests / duration (requests/s); ``output_throughput``:
  output tokens / duration (every sample's or beam's, ``RequestTiming.sequences`` and
  ``other_output_tokens``; TTFT, TPOT and ITL are the timed (first) sequence's: a request counts
  once); ``total_token_throughput``: (prompt + output tokens) / duration.
- TTFT: first token time - arrival. E2EL: last token time - arrival, the request's last of any
  sequence (``RequestTiming.last_token_s``). TPOT, per request with more than one output token,
  of the timed sequence: (its last token - TTFT's) / (output tokens - 1). ITL: every gap between
  two consecutive tokens of one request's timed sequence, pooled over requests.
- For each of ttft, tpot, itl, e2el: ``mean_<m>_ms``, ``median_<m>_ms``, ``std_<m>_ms`` and
  ``p<q>_<m>_ms`` for each percentile asked (default 90 and 99); NaN when there are no samples.
- ``request_goodput``: requests/s meeting every target given (ms), e.g. ``{"ttft": 2000,
  "tpot": 200}``; a request's TPOT is 0 when it has one output token (as in vLLM).
- ``duration`` defaults to the last finish time minus the first arrival.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, Mapping, Optional, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")   # the latencies a goodput target may bound


@dataclass(frozen=True)
class RequestTiming:
    """One finished request's times (seconds, any one clock) and token counts."""
    arrival_s: float
    token_times_s: Sequence[float]   # when each output token was produced, in order (a tuple,
    #                                  or the simulator's array of doubles: 8 bytes a token)
    prompt_tokens: int
    sequences: int = 1               # sequences that each made a token at every one of these
    #                                  times: the simulator's n samples or beams, timed by the first
    other_output_tokens: int = 0     # tokens of the request's other samples, timed apart (the
    #                                  engine's n > 1: each ends at its own length)
    last_token_s: Optional[float] = None   # when the request's last token of any sequence came
    #                                  (None: the timed sequence's last; E2EL and duration end here)

    @property
    def output_tokens(self) -> int:
        """The timed sequence's output tokens (TTFT, TPOT and ITL are its)."""
        return len(self.token_times_s)

    @property
    def all_output_tokens(self) -> int:
        """Every sequence's output tokens (what the throughputs count)."""
        return len(self.token_times_s) * self.sequences + self.other_output_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def end_s(self) -> float:
        """When the request's last token came: its last sequence's, not only the timed one's
        (an n > 1 request whose first sample stopped early ends with its longest)."""
        last = self.token_times_s[-1]
        return last if self.last_token_s is None else max(last, self.last_token_s)

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first; None with one output token."""
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None

    def itl_s(self) -> Iterable[float]:
        times = self.token_times_s
        return (b - a for a, b in zip(times, times[1:]))


def parse_goodput(specs: Sequence[str]) -> Dict[str, float]:
    """``["ttft:2000", "tpot:200"]`` (the ``--goodput`` flag) as ``{"ttft": 2000.0, ...}`` in ms;
    ``ConfigError`` naming the flag, the bad item and the metrics allowed: one target per item
    (``ttft:2000,tpot:200`` is refused with the spaced form), each metric once."""
    out: Dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if "," in spec:
            raise ConfigError(f"--goodput target {spec!r}: give one METRIC:MS per target, "
                              f"separated by spaces (--goodput ttft:2000 tpot:200)")
        if not sep or name not in GOODPUT_METRICS:
            raise ConfigError(f"--goodput target {spec!r} must be METRIC:MS with METRIC one of "
                              f"ttft, tpot, e2el")
        ms = target_ms(value, f"--goodput target {spec!r}")
        if name in out:
            raise ConfigError(f"--goodput names {name} twice ({out[name]:g} and {ms:g} ms): "
                              f"give each metric once")
        out[name] = ms
    return out


def target_ms(text: str, what: str) -> float:
    """A latency target's milliseconds: a finite number > 0, else ConfigError naming ``what``."""
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not 0 < ms < math.inf:
        raise ConfigError(f"{what}: milliseconds must be a finite number > 0")
    return ms


def serving_report(timings: Sequence[RequestTiming], *, duration_s: Optional[float] = None,
                   goodput_ms: Optional[Mapping[str, float]] = None,
                   percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Dict[str, float]:
    """vLLM-named figures of ``timings`` (requests without an output token are not completed)."""
    check_percentiles(percentiles)
    check_goodput(goodput_ms or {})
    done = [t for t in timings if t.token_times_s]
    if duration_s is None:
        duration_s = (max(t.end_s for t in done) - min(t.arrival_s for t in done)
                      if done else 0.0)
    if not 0 <= duration_s < math.inf:
        raise ConfigError(f"duration_s must be finite and >= 0 seconds, got {duration_s!r}")
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    prompt = sum(t.prompt_tokens for t in done)
    output = sum(t.all_output_tokens for t in done)
    out: Dict[str, float] = {
        "completed": len(done), "total_input_tokens": prompt, "total_output_tokens": output,
        "duration": duration_s, "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output), "total_token_throughput": per_s(prompt + output)}
    samples = {"ttft": [t.ttft_s for t in done], "e2el": [t.e2el_s for t in done],
               "tpot": [t.tpot_s for t in done if t.tpot_s is not None], "itl": _pooled_gaps(done)}
    for name in METRICS:
        out.update(_summary_ms(name, samples[name], percentiles))
    if goodput_ms:
        out["request_goodput"] = per_s(sum(_meets(t, goodput_ms) for t in done))
    return out


def _meets(t: RequestTiming, targets_ms: Mapping[str, float]) -> bool:
    values = {"ttft": t.ttft_s, "e2el": t.e2el_s, "tpot": t.tpot_s or 0.0}
    return all(values[name] * 1e3 <= limit for name, limit in targets_ms.items())


def _pooled_gaps(done: Sequence[RequestTiming]) -> "np.ndarray":
    """Every request's gaps between consecutive tokens, pooled: 8 bytes a gap (a standard
    simulation has about 750,000; a list of Python floats took 32 bytes each, three times over)."""
    import numpy as np     # the scheduler imports numpy only where it computes with it
    gaps = [np.diff(np.array(t.token_times_s, dtype=np.float64)) for t in done
            if t.output_tokens > 1]
    return np.concatenate(gaps) if gaps else np.empty(0)


def _summary_ms(name: str, values_s, percentiles: Sequence[float]) -> Dict[str, float]:
    """mean, median, std (population) and percentiles in ms, computed as vLLM's benchmark does
    (numpy's mean, median, std and linear-interpolation percentiles)."""
    import numpy as np
    xs = np.array(values_s, dtype=np.float64) * 1e3
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{q:g}_{name}_ms" for q in percentiles]
    if not xs.size:
        return dict.fromkeys(keys, math.nan)
    xs.sort()
    figures = [xs.mean(), np.median(xs), xs.std(), *np.percentile(xs, list(percentiles))]
    return {key: float(value) for key, value in zip(keys, figures)}


def check_percentiles(percentiles: Sequence[float], what: str = "percentiles") -> None:
    """ConfigError naming ``what`` unless each percentile is a number in [0, 100] and no two
    share a report key (``p<q>_<metric>_ms``, ``q`` written with 6 significant digits): 99.99999
    beside 100 were both ``p100_*``, and one of the two figures was silently dropped."""
    keys: Dict[str, float] = {}
    for q in percentiles:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
            raise ConfigError(f"{what} must be numbers in [0, 100], got {q!r}")
        other = keys.setdefault(f"p{q:g}", q)
        if other != q:
            raise ConfigError(f"{what}: {other!r} and {q!r} would both be reported as p{q:g}; "
                              f"give percentiles that differ in their first 6 significant digits")


def check_goodput(targets_ms: Mapping[str, float]) -> None:
    """ConfigError unless every goodput target is one of ttft, tpot, e2el with finite
    milliseconds > 0 (an unknown metric was a KeyError; NaN or a negative target silently
    counted no request as good)."""
    if not isinstance(targets_ms, Mapping):
        raise ConfigError(f"goodput_ms must map metric names to milliseconds, e.g. "
                          f"{{'ttft': 2000}} (parse_goodput reads the flag's strings), got "
                          f"{type(targets_ms).__name__} {targets_ms!r:.60}")
    for name, ms in targets_ms.items():
        if name not in GOODPUT_METRICS:
            raise ConfigError(f"goodput target {name!r}: the metric must be one of "
                              f"{', '.join(GOODPUT_METRICS)}")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < math.inf:
            raise ConfigError(f"goodput target {name}: milliseconds must be a finite number > 0, "
                              f"got {ms!r}")
