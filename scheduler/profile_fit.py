"""The robust fit of a device profile: timed steps -> design points -> coefficients with
intervals, and whether the host was quiet enough for the precision asked (numpy, no torch).

A *design point* is one step composition (``profile_cost.step_features``: sequences, new and
context tokens, prefill pairs, cold, after idle); ``vmemkv calibrate`` times each one once per
*repeat* of the *shape* (a batch of prompts generated together) that makes it. On a shared host
a step is now and then descheduled and takes several times its cost, so the fit is made on the
MEDIAN of each design point's repeats (the statistic calibrate's repeats bound), by a Huber
loss on relative residuals (a point within ``HUBER_K`` robust standard deviations counts as in
least squares, one the step-cost form cannot follow only linearly), every coefficient >= 0.
Measured on this project's shared host (docs/simulation.md): the fits tie on how far they move
between interleaved halves of a calibration (6-8%), and on the replays (``benchmarks/fidelity.py
--compare-fits``, 13 rounds at loads 2-12, the p90 of |error| of four figures at three rates
summed over three runs) this one scored 467 points, the median regression on every step 468,
the same Huber loss on every step 603 and least squares on every step 851. A fit to every
step divides each residual by its design point's median, the fit to the medians by its own
prediction, neither by the observed time itself: over its own time a slow step's residual can
be no lower than -1 and a fast one's is unbounded, which pulled a fit 20-45% below the typical
step under load.

A design point's median is bounded by a distribution-free 95% interval (order statistics of
its repeats, which needs 6 of them); the coefficients' 95% intervals are percentile bootstrap
intervals, resampling each shape's repeats whole (the steps of one run share its moment of load,
so they are not independent) and refitting; with fewer than 6 repeats of a shape there are
none (too few to resample).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Dict, List, Optional, Sequence

import numpy as np

from .field_checks import check_int
from .profile_cost import FITTED, step_features
from .profile_design import check_steps, undetermined

Z95 = 1.96             # normal quantile of a two-sided 95% interval
MEDIAN_SE = 1.2533     # a median's standard error / (sigma / sqrt(n)) for normal noise
MAD_SIGMA = 1.4826     # sigma / median absolute deviation for normal noise
HUBER_K = 1.345        # Huber's threshold in robust standard deviations (95% efficiency)
LOSSES = ("huber", "l1", "ls")


def point_features(point: Dict) -> tuple:
    """A timed step's row (``step_features``); fields a version 1 point lacks count 0."""
    return step_features(point["batch"], point["new_tokens"], point["context_tokens"],
                         point.get("prefill_pairs", 0), point.get("cold_step", 0),
                         point.get("after_idle", 0))


@dataclass(frozen=True, eq=False)
class DesignPoints:
    """Timed steps grouped by composition: ``rows[d]`` the features of design point d, and for
    every step its design point, its run (one repeat of one shape) and its seconds."""
    rows: np.ndarray          # (D, len(FITTED))
    point_design: np.ndarray  # (P,) design point of each step
    point_run: np.ndarray     # (P,) run of each step
    run_shape: np.ndarray     # (R,) shape of each run
    seconds: np.ndarray       # (P,)

    def medians(self, multiplicity: Optional[np.ndarray] = None) -> np.ndarray:
        """Each design point's median seconds over its repeats, every run counted
        ``multiplicity[run]`` times (default once; a bootstrap resample counts some twice, some
        not at all); NaN for a design point left with no step."""
        take = np.arange(len(self.seconds))
        if multiplicity is not None:
            take = np.repeat(take, multiplicity[self.point_run])
        return grouped_medians(self.point_design[take], self.seconds[take], len(self.rows))

    def samples(self) -> List[np.ndarray]:
        """Each design point's seconds, one per repeat."""
        order = np.argsort(self.point_design, kind="stable")
        bounds = np.searchsorted(self.point_design[order], np.arange(len(self.rows) + 1))
        return [self.seconds[order[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]


def design_points(points: Sequence[Dict]) -> DesignPoints:
    """Group timed steps (``calibrate``'s points; ``shape`` and ``repeat`` 0 where absent) by
    composition, in order of first appearance. ConfigError when there is no step, or naming
    one whose ``seconds`` is not a finite number > 0 (no fit was a numpy error; a step of 0, a
    negative or NaN seconds was dropped from the fit and made its errors negative or NaN) or
    another field is bad (``profile_design.check_steps``)."""
    check_steps(points)
    index: Dict[tuple, int] = {}
    runs: Dict[tuple, int] = {}
    design, run, shapes = [], [], []
    for p in points:
        design.append(index.setdefault(point_features(p), len(index)))
        key = (p.get("shape", 0), p.get("repeat", 0))
        if key not in runs:
            runs[key] = len(runs)
            shapes.append(key[0])
        run.append(runs[key])
    return DesignPoints(np.array(list(index), dtype=float).reshape(-1, len(FITTED)),
                        np.array(design), np.array(run), np.array(shapes),
                        np.array([p["seconds"] for p in points], dtype=float))


def grouped_medians(groups: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """The median of ``values`` in each group 0..count-1 (NaN for an empty group)."""
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    starts = np.searchsorted(g, np.arange(count))
    sizes = np.searchsorted(g, np.arange(count), side="right") - starts
    out = np.full(count, np.nan)
    has = sizes > 0
    lo, hi = starts + (sizes - 1) // 2, starts + sizes // 2
    out[has] = (v[lo[has]] + v[hi[has]]) / 2
    return out


def nnls(gram: np.ndarray, atb: np.ndarray, passive: Optional[np.ndarray] = None) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, given ``gram`` = a^T a and ``atb`` = a^T b (Lawson and
    Hanson's active set method on the normal equations: a few 9 x 9 solves, whatever the
    number of steps). ``passive``: a guess of the coefficients > 0 (kept when it solves the
    problem: a refit's fast path)."""
    n, norm = len(atb), np.sqrt(np.where(np.diag(gram) > 0, np.diag(gram), 1.0))  # columns
    gram, atb = gram / np.outer(norm, norm), atb / norm  # to unit norm: the stopping test left
    #                                                      a term worth 1e-4 of its steps at 0
    tol = 1e-10 * max(1.0, abs(atb).max())

    def solve(on: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        z[on] = np.linalg.lstsq(gram[np.ix_(on, on)], atb[on], rcond=None)[0]
        return z

    if passive is not None and passive.any():
        x = solve(passive)
        grad = atb - gram @ x
        if (x[passive] > 0).all() and (grad[~passive] <= tol).all():
            return x / norm
    x, passive, grad = np.zeros(n), np.zeros(n, bool), atb.copy()
    for _ in range(3 * n):
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while passive.any():
            z = solve(passive)
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            x = x + np.min(x[neg] / (x[neg] - z[neg])) * (z - x)
            passive &= x > 0
            x[~passive] = 0.0
        grad = atb - gram @ x
    return x / norm


def robust_fit(rows: np.ndarray, seconds: np.ndarray, loss: str = "huber",
               start: Optional[np.ndarray] = None, iterations: int = 50,
               typical: Optional[np.ndarray] = None) -> np.ndarray:
    """Coefficients >= 0 minimising the ``loss`` ("huber", "l1" or "ls") of the relative
    residuals (rows . coef - seconds) / typical, by iteratively reweighted non-negative least
    squares; Huber's threshold is ``HUBER_K`` robust standard deviations (MAD) of the
    residuals. ``typical``: each row's typical seconds (a step's design point's median);
    default: the fit's own prediction, updated every iteration. Dividing by the row's OWN
    seconds would skew the fit low wherever they are noisy: a slow row's residual can be no
    lower than -1, a fast one's is unbounded. ``start``: coefficients to begin from."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    predicted_scale = typical is None
    typical = seconds if typical is None else typical
    keep = np.isfinite(seconds) & (seconds > 0) & np.isfinite(typical) & (typical > 0)
    unit = float(np.median(seconds[keep])) if keep.any() else 1.0   # seconds to near 1: steps
    rows, seconds, typical = rows[keep], seconds[keep] / unit, typical[keep] / unit  # of 1e-300
    scale = np.maximum(abs(rows).max(axis=0), 1e-300)   # s were a LinAlgError, of 1e300 s all 0
    x = rows / scale                                    # columns to unit size
    a, b = x / typical[:, None], seconds / typical               # relative residual: a c - b
    coef = nnls(a.T @ a, a.T @ b) if start is None else start * scale / unit
    for _ in range(iterations):
        if predicted_scale:                                      # floored: a 0 prediction
            denominator = np.maximum(x @ coef, 0.1 * typical)
            a, b = x / denominator[:, None], seconds / denominator
        resid = a @ coef - b
        if loss == "ls":
            w = np.ones_like(resid)
        elif loss == "l1":
            w = 1.0 / np.maximum(abs(resid), 1e-6)
        else:
            sigma = max(MAD_SIGMA * np.median(abs(resid - np.median(resid))), 1e-4)
            w = np.minimum(1.0, HUBER_K * sigma / np.maximum(abs(resid), 1e-12))
        new = nnls((a * w[:, None]).T @ a, (a * w[:, None]).T @ b, passive=coef > 0)
        done = np.allclose(new, coef, rtol=1e-7, atol=1e-12)
        coef = new
        if done:
            break
    return coef / scale * unit


def fit_medians(dps: DesignPoints, loss: str = "huber",
                multiplicity: Optional[np.ndarray] = None, start: Optional[np.ndarray] = None,
                iterations: int = 50) -> np.ndarray:
    """Coefficients (``FITTED`` order) fitted to the design points' medians (``medians``)."""
    return robust_fit(dps.rows, dps.medians(multiplicity), loss, start, iterations)


def fit_coefficients(dps: DesignPoints, loss: str = "huber") -> Dict[str, float]:
    """The profile's coefficients: ``fit_medians`` by name."""
    return dict(zip(FITTED, map(float, fit_medians(dps, loss))))


def fit_steps(dps: DesignPoints, loss: str = "huber") -> Dict[str, float]:
    """The coefficients fitted to every timed step instead, each residual relative to its
    design point's median (the alternative ``benchmarks/calibration_stability.py`` and
    ``fidelity.py --compare-fits`` measure against the fit to the medians)."""
    design = dps.point_design
    return dict(zip(FITTED, map(float, robust_fit(dps.rows[design], dps.seconds, loss,
                                                  typical=dps.medians()[design]))))


def coefficient_intervals(dps: DesignPoints, coefficients: Dict[str, float], loss: str = "huber",
                          resamples: int = 200, seed: int = 0
                          ) -> Dict[str, Optional[List[float]]]:
    """95% percentile intervals of each coefficient: ``resamples`` refits (``fit_medians``),
    each after drawing every shape's repeats (whole runs) with replacement. None for every
    coefficient when a shape has fewer than 6 repeats (``median_rank``: too few to resample;
    one repeat gave zero-width intervals that missed their own estimate). ConfigError when
    ``resamples`` is not an int >= 1 (0 was an IndexError)."""
    check_int("resamples", resamples, 1)
    shape_runs = [np.flatnonzero(dps.run_shape == s) for s in np.unique(dps.run_shape)]
    if not median_rank(min(map(len, shape_runs), default=0)):
        return dict.fromkeys(FITTED)
    rng = np.random.default_rng(seed)
    start = np.array([coefficients[k] for k in FITTED])
    fits = []
    for _ in range(resamples):
        count = np.zeros(len(dps.run_shape), dtype=int)
        for runs in shape_runs:
            np.add.at(count, rng.choice(runs, size=len(runs)), 1)
        fits.append(fit_medians(dps, loss, count, start=start, iterations=15))
    lo, hi = np.percentile(np.array(fits), [2.5, 97.5], axis=0)
    return {k: [float(a), float(b)] for k, a, b in zip(FITTED, lo, hi)}


def median_rank(n: int) -> int:
    """The largest k such that the k-th smallest and k-th largest of ``n`` repeats bound their
    median with probability >= 95% whatever the (continuous) noise: 1 - 2 P(Binomial(n, 1/2)
    < k) >= 0.95. 0 when none does (n < 6: even the minimum and maximum of 5 cover 93.75%)."""
    k, below = 0, 0
    while k < n // 2:
        below += math.comb(n, k)                     # P(Binomial < k + 1) x 2^n
        if 1 - 2 * below / 2 ** n < 0.95:
            break
        k += 1
    return k


def median_half_widths(samples: Sequence[np.ndarray]) -> np.ndarray:
    """For each design point, the half-width of its median's distribution-free 95% interval
    (order statistics, ``median_rank``) relative to the median; inf with fewer than 6 repeats
    (no such interval exists: the spread is not bounded yet). A percentile bootstrap of 3
    repeats would give their [min, max], which covers the median only 75% of the time."""
    out = np.full(len(samples), np.inf)
    for d, values in enumerate(samples):
        k = median_rank(len(values))
        if k:
            v = np.sort(values)
            out[d] = (v[-k] - v[k - 1]) / 2 / np.median(v)
    return out


@functools.lru_cache(maxsize=None)
def mad_bias(n: int) -> float:
    """The median of MAD x 1.4826 over ``n`` standard normal draws (by a seeded simulation):
    the MAD of few repeats reads low (0.80 sigma at 6, 0.90 at 12), this corrects it."""
    x = np.random.default_rng(n).normal(size=(4000, n))
    return float(np.median(MAD_SIGMA * np.median(abs(x - np.median(x, axis=1, keepdims=True)),
                                                 axis=1)))


def relative_spreads(samples: Sequence[np.ndarray]) -> np.ndarray:
    """Each design point's robust relative standard deviation over its repeats: MAD x 1.4826 /
    median, corrected for few repeats (``mad_bias``: median-unbiased for normal noise); NaN with
    fewer than two."""
    return np.array([MAD_SIGMA * np.median(abs(v - np.median(v))) / np.median(v) / mad_bias(len(v))
                     if len(v) >= 2 else np.nan for v in samples])


def repeats_for(spread: float, precision: float) -> int:
    """About how many repeats bring a median's 95% interval to +-``precision`` (relative) at a
    relative standard deviation ``spread``: normal noise, half-width 1.96 x 1.2533 x spread /
    sqrt(n), at least 6 (``median_rank``)."""
    try:
        return max(6, math.ceil((Z95 * MEDIAN_SE * spread / precision) ** 2))
    except OverflowError:       # --precision 1e-200: past a float (a traceback after timing)
        return max(6, math.ceil((Fraction(Z95 * MEDIAN_SE * spread) / Fraction(precision)) ** 2))


def percent(x: float) -> str:
    """``x`` in percent: to 0.1%, in 3 digits below 0.1% (--precision 1e-200 read +-0.0%)."""
    return f"{x:.1%}" if x >= 1e-3 else f"{x * 100:.3g}%"


def count_text(n: int) -> str:
    """``n`` as text, in 3 digits past 10**9 (a tiny precision needs 10**600 repeats)."""
    return str(n) if n <= 10**9 else f"{Decimal(n):.3g}"


def shape_precisions(dps: DesignPoints, half_widths: np.ndarray) -> Dict[int, float]:
    """For each shape, the 90th percentile of its design points' ``half_widths``: the
    precision that 90% of what the shape measures is known to."""
    shape_of_step = dps.run_shape[dps.point_run]
    return {int(s): p90(half_widths[np.unique(dps.point_design[shape_of_step == s])])
            for s in np.unique(dps.run_shape)}


def p90(values: np.ndarray) -> float:
    """The 90th percentile as an order statistic (the one at or above: no interpolation, so
    an unmeasured point's inf stays inf)."""
    return float(np.percentile(values, 90, method="higher"))


@dataclass(frozen=True)
class NoiseCheck:
    """Whether the design points' medians reached the requested precision, and if not, how
    far the host's noise is from allowing it. The criterion, here and in calibrate's repeats:
    90% of the design points' medians within +-``precision`` (``median_half_widths``)."""
    precision: float        # requested relative half-width
    max_repeats: int        # the cap on repeats per shape
    design_points: int
    outside: int            # design points whose median is known only to worse than precision
    spread: float           # relative spread of a step's time: median over the design points
                            # measured more than once (``measured`` of them)
    spread_p90: float       # ... its 90th percentile (NaN: one repeat, not measured)
    achieved: float         # 90th percentile of the design points' half-widths reached
    needed_repeats: int     # repeats that bring 90% of design points within precision
    measured: int = 0       # design points with 2 samples or more (whose spread is measured)

    @property
    def noisy(self) -> bool:
        return not self.achieved <= self.precision

    def message(self) -> str:
        """One paragraph: what the host's noise allowed against what was asked."""
        if math.isnan(self.spread_p90):
            return ("one repeat per design point: the step time's spread is not measured "
                    "(--repeats 6 or more)")
        head = (f"the step time's relative spread is {self.spread:.1%} (median over the "
                f"{self.measured} of {self.design_points} design points measured more than "
                f"once, {self.spread_p90:.1%} at the 90th "
                f"percentile); +-{percent(self.precision)} on 90% of the design points' medians "
                f"needs about {count_text(self.needed_repeats)} repeats")
        if not self.noisy:
            return f"{head}: reached, 90% within +-{self.achieved:.1%}"
        if math.isinf(self.achieved):
            return (f"{head}; at most {self.max_repeats} repeats cannot bound a median (a "
                    f"distribution-free 95% interval needs 6): --max-repeats 6 or more")
        return (f"{head}; running with the cap of {self.max_repeats} gives +-{self.achieved:.1%} "
                f"({self.outside} of {self.design_points} design points outside "
                f"+-{percent(self.precision)}): the host is too noisy for the requested precision")

    def as_dict(self) -> Dict:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in fields.items()}
        return {**clean, "noisy": self.noisy, "message": self.message()}


def noise_check(dps: DesignPoints, half_widths: np.ndarray, precision: float,
                max_repeats: int) -> NoiseCheck:
    """The NoiseCheck of design points whose medians' relative ``half_widths`` are given."""
    spreads = relative_spreads(dps.samples())
    measured = spreads[np.isfinite(spreads)]
    spread, spread_p90 = ((float(np.median(measured)), float(np.percentile(measured, 90)))
                          if len(measured) else (math.nan, math.nan))
    needed = repeats_for(spread_p90, precision) if math.isfinite(spread_p90) else 0
    return NoiseCheck(precision, max_repeats, len(dps.rows), int((half_widths > precision).sum()),
                      spread, spread_p90, p90(half_widths), needed, len(measured))


def fit_profile(points: Sequence[Dict], precision: float, max_repeats: int,
                resamples: int = 200, seed: int = 0) -> Dict:
    """A profile's fitted parts from its timed ``points``: ``coefficients``, their
    ``coefficient_intervals`` (None for those ``profile_design.undetermined``), the ``fit``'s
    relative error over the design points' medians and what they leave ``undetermined``, and
    the ``noise`` check (``NoiseCheck.as_dict``) against ``precision``."""
    dps = design_points(points)
    coefficients, medians = fit_coefficients(dps), dps.medians()
    errors = abs(dps.rows @ np.array([coefficients[k] for k in FITTED]) - medians) / medians
    widths = median_half_widths(dps.samples())
    unsure = undetermined(dps.rows)         # the fit's split and their [x, x] intervals arbitrary
    intervals = coefficient_intervals(dps, coefficients, resamples=resamples, seed=seed)
    return {"coefficients": coefficients,
            "coefficient_intervals": {k: None if k in unsure else v for k, v in intervals.items()},
            "fit": {"median_rel_error": float(np.median(errors)), "undetermined": unsure,
                    "max_rel_error": float(errors.max()), "design_points": len(dps.rows),
                    "method": "Huber loss on the relative residuals of the design points' "
                              "medians of repeats, coefficients >= 0; intervals: 95% "
                              "percentile bootstrap over each shape's repeats, "
                              f"{resamples} refits"},
            "noise": noise_check(dps, widths, precision, max_repeats).as_dict()}
