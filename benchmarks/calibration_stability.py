"""How much a calibration's fit moves between calibrations on this host, fit by fit, on the same
timed steps: the robust fit (Huber on design-point medians) against the fits before it.

    .venv/bin/python benchmarks/calibration_stability.py [--calibrations 3] [--json out.json]
        [--max-repeats 12]

Each calibration is one ``vmemkv calibrate`` run (``runtime.calibrate.calibrate``); every fit
below is made on its points, so the fits differ only in how they use the same data. Per fit:

- *halves*: within one calibration, the fit on its even repeats against the fit on its odd
  ones (interleaved in time: the host's drift reaches both alike), as the relative difference
  of the step time each predicts for steps a replay makes (``REFERENCE``), median over those
  steps and the calibrations; at 2 + 2 repeats (the calibration before issue 34 timed 2) and at
  half of all the repeats each;
- *across*: between the calibrations (all repeats, the host's drift included), the spread
  (max - min) / median of those predictions and of each coefficient, and the fit's median
  error on the OTHER calibrations' design-point medians.

First, per calibration, what ``vmemkv calibrate`` reported: the load, the host's spread, the
precision 90% of the design points reached, the coefficients' 95% interval widths (relative,
median over the coefficients) and whether it warned.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List

import numpy as np

from vmemkv.benchmarks.common import exit_status, flags_given
from vmemkv.cli import OneLineArgumentParser
from vmemkv.runtime.calibrate import write_json_whole
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import FITTED, step_features
from vmemkv.scheduler.profile_design import check_steps
from vmemkv.scheduler.profile_fit import design_points, fit_coefficients, fit_profile, \
    fit_steps, point_features
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, POSITIVE_INT, DistinctValues, result_file

# steps a replay makes (batch, new, context, prefill pairs, cold, after idle): decodes warm and
# cold, single prompts back to back and after idle, a prompt beside four decodes
REFERENCE = {"decode b1 ctx150": (1, 1, 150, 0, 0, 0), "decode b4 ctx600": (4, 4, 600, 0, 0, 0),
             "decode b8 ctx1500": (8, 8, 1500, 0, 0, 0), "cold b4 ctx600": (4, 4, 600, 0, 1, 0),
             "prefill 16": (1, 16, 16, 120, 0, 0), "prefill 64": (1, 64, 64, 2016, 0, 0),
             "prefill 140": (1, 140, 140, 9730, 0, 0), "prefill 400": (1, 400, 400, 79800, 0, 0),
             "prefill 140 after idle": (1, 140, 140, 9730, 0, 1),
             "140 + 4 decodes": (5, 144, 740, 9730, 0, 0)}


def legacy_fit(points, iterations: int = 50) -> Dict[str, float]:
    """The fit before issue 34 (runtime/calibrate.py at 64b2a6f), unchanged: summed absolute
    error over every timed step by IRLS, unconstrained, negative coefficients clipped to 0."""
    x = np.array([point_features(p) for p in points])
    y = np.array([p["seconds"] for p in points])
    weight = np.ones_like(y)
    for _ in range(iterations):
        coef, *_ = np.linalg.lstsq(x * weight[:, None], y * weight, rcond=None)
        weight = 1.0 / np.sqrt(np.maximum(np.abs(x @ coef - y), 1e-6))
    return dict(zip(FITTED, (max(0.0, float(c)) for c in coef)))


def least_squares(points) -> Dict[str, float]:
    """Ordinary least squares over every timed step (absolute seconds), unconstrained, clipped."""
    x = np.array([point_features(p) for p in points])
    coef, *_ = np.linalg.lstsq(x, np.array([p["seconds"] for p in points]), rcond=None)
    return dict(zip(FITTED, (max(0.0, float(c)) for c in coef)))


def repeats_in(points, keep) -> list:
    return [p for p in points if p.get("repeat", 0) in keep]


def median_fit(loss: str) -> Callable:
    return lambda points: fit_coefficients(design_points(points), loss)


FITS: Dict[str, Callable] = {
    "before: L1 per step": legacy_fit,
    "least squares per step": least_squares,
    "Huber per step": lambda points: fit_steps(design_points(points)),
    "least squares on medians": median_fit("ls"),
    "Huber on medians (new)": median_fit("huber"),
}


def predict(coefficients: Dict[str, float], features) -> float:
    return float(np.dot([coefficients[k] for k in FITTED], step_features(*features)))


def cross_error(fit: Dict[str, float], points) -> float:
    """Median relative error of ``fit`` on the design-point medians of another calibration."""
    dps = design_points(points)
    medians = dps.medians()
    return float(np.median(abs(dps.rows @ np.array([fit[k] for k in FITTED]) - medians) / medians))


def difference(a: Dict[str, float], b: Dict[str, float]) -> Dict[str, float]:
    """Relative difference of two fits: each reference step's predicted time, |a - b| / mean."""
    out = {}
    for ref, x in REFERENCE.items():
        pa, pb = predict(a, x), predict(b, x)
        out[ref] = abs(pa - pb) / ((pa + pb) / 2)
    return out


def split_halves(points, fit: Callable, repeats: int) -> Dict[str, float]:
    """The difference between ``fit`` on the even and on the odd of the first ``repeats``
    repeats of one calibration: interleaved in time, so a drift of the host's load reaches
    both halves alike and what differs is the noise the fit let through."""
    even = repeats_in(points, range(0, repeats, 2))
    odd = repeats_in(points, range(1, repeats, 2))
    return difference(fit(even), fit(odd))


def spread(values: List[float]) -> float:
    """(max - min) / median; 0 when every value is 0."""
    mid = float(np.median(values))
    return (max(values) - min(values)) / mid if mid else (0.0 if max(values) == 0 else float("inf"))


def compare(calibrations: List[List[Dict]]) -> Dict[str, Dict]:
    """For each fit: the split-half differences of its predictions at 2 + 2 and at all repeats
    (median over reference steps and calibrations), and across the calibrations (all repeats;
    the host's drift included) the predictions' and coefficients' spreads and the median
    error on the other calibrations' design points."""
    most = min(max(p.get("repeat", 0) for p in pts) + 1 for pts in calibrations)
    out = {}
    for name, fit in FITS.items():
        halves = {n: float(np.median([d for pts in calibrations
                                      for d in split_halves(pts, fit, n).values()]))
                  for n in (4, most)}
        fits = [fit(points) for points in calibrations]
        cross = [cross_error(f, other) for i, f in enumerate(fits)
                 for j, other in enumerate(calibrations) if i != j]
        predictions = {ref: spread([predict(f, x) for f in fits]) for ref, x in REFERENCE.items()}
        out[name] = {"split_half_2_repeats": halves[4], f"split_half_{most // 2}_repeats":
                     halves[most], "split_half_all": halves[most],
                     "prediction_spread": predictions,
                     "median_prediction_spread": float(np.median(list(predictions.values()))),
                     "coefficients": {k: [f[k] for f in fits] for k in FITTED},
                     "coefficient_spread": {k: spread([f[k] for f in fits]) for k in FITTED},
                     "cross_error": float(np.median(cross)) if cross else float("nan")}
    return out


def noise_lines(calibrations: List[List[Dict]], loads, precision: float) -> List[str]:
    """Per calibration: its load, the host's spread, the coefficients' interval widths (relative
    to each coefficient, median over them) and whether the noise warning fired."""
    lines = [f"{'calibration':<12}{'1-min load':>14}{'spread':>8}{'90% within':>12}"
             f"{'interval width':>16}  warning at +-{precision:.0%}"]
    for k, (points, load) in enumerate(zip(calibrations, loads)):
        fitted = fit_profile(points, precision=precision, max_repeats=12)
        noise, c, iv = fitted["noise"], fitted["coefficients"], fitted["coefficient_intervals"]
        widths = [(iv[n][1] - iv[n][0]) / c[n] for n in FITTED if c[n] > 0 and iv[n] is not None]
        width = np.median(widths) if widths else None          # none below 6 repeats
        lines.append(f"{k + 1:<12}{f'{load[0]:.2f} -> {load[1]:.2f}':>14}"
                     f"{_percent(noise['spread'], 8, 1)}{_percent(noise['achieved'], 11, 1)} "
                     f"{_percent(width, 15, 0)}  "
                     f"{'yes' if noise['noisy'] else 'no'}")
    return lines


def _percent(value, width: int, digits: int) -> str:
    """``value`` as a percentage right-aligned in ``width``; n/a for None (not measured)."""
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}%}"


def step_kind(point: Dict) -> str:
    """A timed step's kind for the residual table: warm or cold decode of b sequences, a
    prefill of b whole prompts (one prompt: back to back or after idle), or mixed (a prompt
    beside running decodes, ``calibrate --join-lengths``)."""
    b, new, pairs = point["batch"], point["new_tokens"], point.get("prefill_pairs", 0)
    if not pairs:
        return f"{'cold' if point.get('cold_step') else 'warm'} decode b{b}"
    c = new // b
    if new % b or pairs != b * c * (c - 1) // 2:
        return f"mixed b{b}"
    if b > 1:
        return f"prefill b{b}"
    return "prefill 1 prompt" + (" after idle" if point.get("after_idle") else "")


def residual_lines(calibrations: List[List[Dict]], held_out: List[set]) -> List[str]:
    """The new fit's median relative error at the design points' medians, by step kind, per
    calibration: structure the step-cost form misses shows as a kind off in every one. The
    shapes in ``held_out[i]`` are left out of calibration i's fit (their steps marked)."""
    table: Dict[str, List[str]] = {}
    for points, out in zip(calibrations, held_out):
        dps = design_points(points)
        fit = fit_coefficients(design_points([p for p in points if p["shape"] not in out]))
        medians = dps.medians()
        errors = (dps.rows @ np.array([fit[k] for k in FITTED]) - medians) / medians
        kinds: Dict[str, List[float]] = {}
        seen = set()
        for p, d in zip(points, dps.point_design):
            if d not in seen:
                seen.add(d)
                kind = step_kind(p) + (" (held out)" if p["shape"] in out else "")
                kinds.setdefault(kind, []).append(errors[d])
        for kind, e in kinds.items():
            table.setdefault(kind, []).append(f"{np.median(e):+7.1%} ({len(e):3d})")
    return [f"{'step kind':<30}fit error, median (design points), per calibration"] + [
        f"{kind:<30}" + "  ".join(cells) for kind, cells in sorted(table.items())]


def join_shapes(profile: Dict) -> set:
    """The shapes of a profile whose batch a prompt joined (``calibrate --join-lengths``)."""
    return {i for i, shape in enumerate(profile["calibration"].get("shapes", []))
            if len(shape) > 4 and shape[4]}


def print_table(result: Dict[str, Dict], repeats: int) -> None:
    print(f"{'fit':<26}{'halves 2+2':>11}{f'halves {repeats // 2}+{repeats // 2}':>12}"
          f"{'across':>8}{'cross err':>10}  coefficients across "
          f"({', '.join(k.replace('per_', '')[:-2] for k in FITTED)})")
    for name, r in result.items():
        coef = " ".join(f"{r['coefficient_spread'][k]:5.0%}" for k in FITTED)
        print(f"{name:<26}{r['split_half_2_repeats']:>11.1%}{r['split_half_all']:>12.1%}"
              f"{r['median_prediction_spread']:>8.1%}{r['cross_error']:>10.1%}  {coef}")


def main(argv=None) -> int:
    from vmemkv.runtime.calibrate import calibrate
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrations", type=POSITIVE_INT, default=3)
    ap.add_argument("--max-repeats", type=POSITIVE_INT, default=12)
    ap.add_argument("--join-lengths", type=POSITIVE_INT, nargs="*", default=[],
                    action=DistinctValues,
                    help="also time prompts of these lengths joining running batches of 4 and "
                         "12 (mixed steps; calibrate --join-lengths)")
    ap.add_argument("--hold-out-joins", action="store_true",
                    help="fit the residual table without the joining shapes: how well the "
                         "step-cost form predicts mixed steps it never saw")
    ap.add_argument("--precision", type=POSITIVE_FLOAT, default=0.05,
                    help="the precision the noise check is made against")
    ap.add_argument("--json", metavar="FILE", type=result_file, help="also write the result here (whole)")
    ap.add_argument("--from", dest="saved", metavar="FILE", nargs="+", action=DistinctValues,
                    help="compare saved calibrations instead of running: an earlier --json, "
                         "or device profiles (vmemkv calibrate --out)")
    args = ap.parse_args(argv)
    ignored = flags_given(ap, args, ("calibrations", "max_repeats", "join_lengths"))
    if args.saved and ignored:     # each was dropped in silence
        ap.error(f"{ignored[0]} sets the calibrations this run would make, and --from "
                 f"compares saved ones instead: drop it")
    calibrations, loads, joins = [], [], []
    for path in args.saved or []:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or "points" not in saved \
                or "calibration" not in saved and "load_1min" not in saved:   # a KeyError
            ap.error(f"--from {path}: neither a device profile (vmemkv calibrate --out) nor "
                     f"this benchmark's --json")
        ones = [saved["points"]] if "calibration" in saved else saved["points"]
        try:                        # a bad step was a TypeError or KeyError traceback
            for points in ones if isinstance(ones, list) else [ones]:
                check_steps(points)
        except ConfigError as error:
            ap.error(f"--from {path}: {error}")
        if "calibration" in saved:                                   # a device profile
            calibrations.append(saved["points"])
            loads.append(saved["calibration"]["load_1min"])
            joins.append(join_shapes(saved))
        else:
            calibrations += saved["points"]
            loads += saved["load_1min"]
            joins += [set(j) for j in saved.get("join_shapes", [[]] * len(saved["points"]))]
    for k in range(0 if args.saved else args.calibrations):
        print(f"calibration {k + 1}/{args.calibrations} (1-minute load "
              f"{os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        profile = calibrate(max_repeats=args.max_repeats, join_lengths=args.join_lengths)
        calibrations.append(profile["points"])
        joins.append(join_shapes(profile))
        loads.append(profile["calibration"]["load_1min"])
    result = compare(calibrations)
    print("\n".join(noise_lines(calibrations, loads, args.precision)))
    print("\n".join(residual_lines(calibrations, joins if args.hold_out_joins
                                   else [set()] * len(calibrations))))
    print_table(result, min(max(p["repeat"] for p in pts) + 1 for pts in calibrations))
    if args.json:
        write_json_whole(args.json, {"load_1min": loads, "fits": result, "points": calibrations,
                                     "join_shapes": [sorted(j) for j in joins]})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status("calibration_stability", main))
