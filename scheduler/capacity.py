"""Capacity search: the highest load at which a policy still meets latency targets (an SLO).

The load is one positive number ``x`` that ``make_entries(x)`` turns into a workload: the rate
scale of a trace (arrival times divided by ``x``) or the Poisson rate of a generated workload
(requests/s). The search assumes the SLO figures only worsen as ``x`` grows (more load, longer
queues), as Vidur's capacity search does:

    1. bracket: from ``start``, double while the SLO holds, halve while it does not
       (at most ``max_probes`` simulations in all);
    2. bisect in log space until hi / lo <= 1 + ``rel_tol``; the answer is ``lo``, the highest
       load seen to meet every target.

An SLO is ``{"ttft_p90": 2000, "tpot_p99": 200}`` (milliseconds), written on the command line
as ``ttft_p90=2000,tpot_p99=200``: METRIC_STAT with METRIC one of ttft, tpot, itl, e2el and
STAT ``p<q>`` (a percentile), ``mean`` or ``median``; each names a figure of
``report.serving_report`` (``p90_ttft_ms``...). A target whose figure the workload does not
have (NaN: TPOT or ITL when every request has one output token) is refused by name at the first
probe (``UndefinedSloTarget``); compared as a number it would read as "no load meets it".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .errors import ConfigError
from .report import METRICS, target_ms
from .simulator import SimConfig, simulate
from .workload import TraceEntry

_TARGET = re.compile(r"(ttft|tpot|itl|e2el)_(mean|median|p\d+(?:\.\d+)?)")


def parse_slo(text: str) -> Dict[str, float]:
    """``"ttft_p90=2000,tpot_p99=200"`` -> ``{"ttft_p90": 2000.0, "tpot_p99": 200.0}`` (ms);
    ConfigError naming the bad item, the metrics and the statistics allowed, or a figure given
    twice (``ttft_p90=2000,ttft_p90=500``, or ``ttft_p90`` and ``ttft_p90.0``, ``ttft_p50``
    and ``ttft_median``: the later target silently replaced the earlier, or both were
    searched under two names)."""
    out: Dict[str, float] = {}
    given: Dict[str, Tuple[str, str]] = {}   # figure (a median as p50) -> the item, its figure
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        m = _TARGET.fullmatch(name.strip())
        if not sep or not m or (m.group(2).startswith("p") and not 0 <= float(m.group(2)[1:]) <= 100):
            raise ConfigError(f"SLO target {item!r} must be METRIC_STAT=MS with METRIC one of "
                              f"{', '.join(METRICS)} and STAT mean, median or p0..p100 "
                              f"(e.g. ttft_p90=2000)")
        ms = target_ms(value, f"SLO target {item!r}")
        figure = report_key(name.strip())
        same = figure.replace("median_", "p50_", 1)    # numpy's median is its 50th percentile
        if same in given:
            earlier, named = given[same]
            raise ConfigError(f"SLO target {item!r} names {figure} again ({earlier!r} did"
                              f"{': a median is p50' if named != figure else ''}): give each "
                              f"target once")
        given[same] = item, figure
        out[name.strip()] = ms
    if not out:
        raise ConfigError(f"SLO {text!r} names no target; e.g. ttft_p90=2000,tpot_p99=200")
    return out


def report_key(target: str) -> str:
    """The serving-report figure an SLO target names: ``ttft_p90`` -> ``p90_ttft_ms``."""
    metric, stat = target.split("_", 1)
    if stat.startswith("p"):
        stat = f"p{float(stat[1:]):g}"
    return f"{stat}_{metric}_ms"


def percentiles_of(slo: Dict[str, float]) -> Tuple[float, ...]:
    """The percentiles the serving report must compute for ``slo`` (and the usual 50/90/99)."""
    qs = {50.0, 90.0, 99.0}
    qs.update(float(t.split("_", 1)[1][1:]) for t in slo if t.split("_", 1)[1].startswith("p"))
    return tuple(sorted(qs))


@dataclass
class Probe:
    """One simulation of the search: the load, whether every target held, the figures."""
    load: float
    meets: bool
    figures: Dict[str, float]


@dataclass
class CapacityResult:
    """The highest load that met the SLO (None if even the lowest probed did not);
    ``bounded``: a higher probed load failed it (False: every probe met it, the true capacity
    may be higher; give more probes or more requests)."""
    max_load: Optional[float]
    slo: Dict[str, float]
    probes: List[Probe] = field(default_factory=list)
    bounded: bool = False

    @property
    def best(self) -> Optional[Probe]:
        """The probe at ``max_load``."""
        return next((p for p in self.probes if p.load == self.max_load), None)


def find_max_load(make_entries: Callable[[float], Sequence[TraceEntry]], config: SimConfig,
                  slo: Dict[str, float], start: float = 1.0, rel_tol: float = 0.02,
                  max_probes: int = 24, on_probe: Optional[Callable[[Probe], None]] = None
                  ) -> CapacityResult:
    """Search the load (module docstring); ``on_probe`` sees every probe as it finishes."""
    result = CapacityResult(None, dict(slo))
    qs = percentiles_of(slo)

    def probe(load: float) -> bool:
        try:
            entries = make_entries(load)
        except ConfigError as error:     # a load the workload cannot take: the search's edge
            if load == start:
                raise
            raise LoadOutOfRange(str(error)) from None
        report = simulate(entries, config).report(percentiles=qs)
        check_defined(slo, report)
        meets = all(report[report_key(t)] <= ms for t, ms in slo.items())
        result.probes.append(Probe(load, meets, report))
        if on_probe is not None:
            on_probe(result.probes[-1])
        return meets

    lo, hi = search_max_load(probe, start, rel_tol, max_probes)
    result.max_load, result.bounded = lo, hi is not None
    return result


class UndefinedSloTarget(ConfigError):
    """An SLO target whose figure the workload does not have (NaN in the serving report):
    no load can meet it or fail it, so the search has no answer to give."""


def check_defined(slo: Dict[str, float], report: Dict[str, float]) -> None:
    """``UndefinedSloTarget`` naming the first target of ``slo`` whose figure in ``report`` is
    NaN, and why (a NaN compared with the target is False: it read as "no load meets it")."""
    for target in slo:
        key, metric = report_key(target), target.split("_", 1)[0]
        if not math.isnan(report[key]):
            continue
        if not report["completed"]:
            why = "no request completed"
        elif metric in ("tpot", "itl"):
            why = (f"no request has two output tokens or more, and {metric} is measured "
                   f"between a request's tokens")
        else:
            why = "the serving report gives NaN"
        raise UndefinedSloTarget(f"SLO target {target}: {key} is undefined on this workload "
                                 f"({why}), so no load meets or fails it; leave {target} out "
                                 f"of the SLO")


def search_max_load(meets: Callable[[float], bool], start: float, rel_tol: float,
                    max_probes: int) -> Tuple[Optional[float], Optional[float]]:
    """(lo, hi) of the search over a ``meets(load)`` that holds below some load and fails above
    it: lo the highest load seen to meet it (None: none did), hi the lowest seen to fail (None:
    none did); hi / lo <= 1 + ``rel_tol`` unless ``max_probes`` calls of ``meets`` ran out."""
    if not (start > 0 and math.isfinite(start)):
        raise ConfigError(f"the search's start load must be a finite number > 0, got {start!r}")
    if not 0 < rel_tol < 1:
        raise ConfigError(f"rel_tol must be in (0, 1), got {rel_tol!r}")
    calls = [0]

    def probe(load: float) -> bool:
        calls[0] += 1
        return meets(load)

    lo, hi = _bracket(probe, start, max_probes)
    while lo is not None and hi is not None and hi / lo > 1 + rel_tol and calls[0] < max_probes:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo, hi


class LoadOutOfRange(ConfigError):
    """A load past what the workload can take (halved until an arrival passes the clock's
    range, doubled past its limits): the bracket ends there, as if probes had run out."""


def _bracket(probe: Callable[[float], bool], start: float, max_probes: int):
    """(lo, hi): lo met the SLO (None: none did), hi did not (None: all did), adjacent powers
    of two times ``start``; at most ``max_probes`` probes (the bisection gets what is left),
    fewer where the workload refuses the next load (``LoadOutOfRange``)."""
    load, meets = start, probe(start)
    for _ in range(max_probes - 1):
        nxt = load * 2 if meets else load / 2
        try:
            if probe(nxt) != meets:
                return (nxt, load) if not meets else (load, nxt)
        except LoadOutOfRange:
            break
        load = nxt
    return (load, None) if meets else (None, load)
