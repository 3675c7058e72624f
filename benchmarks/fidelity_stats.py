"""The statistics of ``benchmarks/fidelity.py --repeats N``: each figure's prediction error over
the N calibrate-and-replay rounds, beside the engine's own run-to-run spread on the same trace.

One round's error of a figure is (simulated - measured) / measured. Over the rounds: the
median error, its min and max, and the p90 of the absolute error (the 90th percentile,
interpolated between order statistics as numpy's default does: with 5 rounds, 60% of the way
from the 4th to the 5th largest |error|). The *engine floor* is the same statistics for the
engine predicting itself: every engine replay j taken as the prediction of every other replay
i of the same trace and rate, (m_j - m_i) / m_i over all N (N - 1) ordered pairs. A simulator
that predicted the engine exactly up to its run-to-run noise would score about the floor; no
deterministic prediction can do better on average.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from vmemkv.scheduler.metrics import percentile


def error_summary(errors: Sequence[float]) -> Optional[Dict[str, float]]:
    """Median, min, max and p90 of |error| of ``errors`` (relative); None when empty."""
    if not errors:
        return None
    ordered = sorted(errors)
    return {"median": percentile(ordered, 50), "min": ordered[0], "max": ordered[-1],
            "p90_abs": percentile(sorted(abs(e) for e in errors), 90), "n": len(errors)}


def engine_floor_errors(measured: Sequence[float]) -> List[float]:
    """(m_j - m_i) / m_i for every ordered pair i != j of the engine's runs ``measured``."""
    return [(b - a) / a for i, a in enumerate(measured) for j, b in enumerate(measured) if i != j]


def spread(values: Sequence[float]) -> Dict[str, float]:
    ordered = sorted(values)
    return {"median": percentile(ordered, 50), "min": ordered[0], "max": ordered[-1]}


def summarize(rounds: List[Dict], figures: Sequence[str], goals: Dict[str, float]) -> Dict:
    """Per rate scale (a string key, as JSON has it) and figure: the engine's and the
    simulator's figures over the rounds (median, min, max), the simulator's error
    (``error_summary``), the engine floor, and whether the p90 of |error| is within the goal.
    ``rounds``: each with ``comparisons``, one ``fidelity.measure`` result per rate."""
    by_rate: Dict[str, List[Dict]] = {}
    for r in rounds:
        for c in r["comparisons"]:
            by_rate.setdefault(f"{c['rate_scale']:g}", []).append(c)
    out = {}
    for rate, comparisons in by_rate.items():
        out[rate] = {"rounds": len(comparisons),
                     "submit_lag_max_ms": max(c["submit_lag_ms"]["max"] for c in comparisons),
                     "load_1min": [min(min(c["load_1min"]) for c in comparisons),
                                   max(max(c["load_1min"]) for c in comparisons)]}
        for k in figures:
            measured = [c["measured"][k] for c in comparisons]
            errors = error_summary([c["rel_error"][k] for c in comparisons])
            out[rate][k] = {"engine": spread(measured),
                            "simulator": spread([c["simulated"][k] for c in comparisons]),
                            "error": errors,
                            "engine_floor": error_summary(engine_floor_errors(measured)),
                            "within_goal": errors["p90_abs"] <= goals[k]}
    return out


def table_lines(summary: Dict, figures: Sequence[str], goals: Dict[str, float]) -> List[str]:
    """The summary as aligned text: one line per rate and figure."""
    lines = [f"{'rate':>5} {'figure':<18}{'engine: median [min, max]':>28}"
             f"{'error: median [min, max]':>28}{'p90|err|':>9}{'floor p90|err|':>16}"
             f"{'goal':>6}"]
    for rate, s in summary.items():
        for k in figures:
            f = s[k]
            e, floor = f["error"], f["engine_floor"]
            lines.append(
                f"{rate:>5} {k:<18}{f['engine']['median']:>12.2f} [{f['engine']['min']:.2f}, "
                f"{f['engine']['max']:.2f}]".ljust(52)
                + f"{e['median']:>+9.1%} [{e['min']:+.1%}, {e['max']:+.1%}]".rjust(28)
                + f"{e['p90_abs']:>9.1%}"
                + (f"{floor['p90_abs']:>16.1%}" if floor else f"{'-':>16}")
                + f"{goals[k]:>5.0%}{'' if f['within_goal'] else ' !'}")
    return lines


def fit_lines(rounds: List[Dict], figures: Sequence[str]) -> List[str]:
    """``--compare-fits``: per fit and rate, each figure's median error and p90 of |error|
    over the rounds, and the mean of the four p90s."""
    errors: Dict[tuple, List[float]] = {}
    for r in rounds:
        for c in r["comparisons"]:
            for name, fit in c.get("fits", {}).items():
                for k in figures:
                    errors.setdefault((name, f"{c['rate_scale']:g}", k), []).append(
                        fit["rel_error"][k])
    names = list(dict.fromkeys(key[0] for key in errors))
    rates = sorted({key[1] for key in errors}, key=float)
    lines = [f"{'fit':<28}{'rate':>5}" + "".join(f"{k[:16]:>18}" for k in figures)
             + f"{'mean p90':>10}"]
    for name in names:
        for rate in rates:
            cells = [error_summary(errors[(name, rate, k)]) for k in figures]
            lines.append(f"{name:<28}{rate:>5}" + "".join(
                f"{c['median']:>+9.1%} {c['p90_abs']:>7.1%}" for c in cells)
                + f"{sum(c['p90_abs'] for c in cells) / len(cells):>10.1%}")
    return lines
