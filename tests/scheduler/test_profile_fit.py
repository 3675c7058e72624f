"""The robust calibration fit on synthetic calibrations with known coefficients and known noise
(no engine, no wall clock): it recovers the coefficients within its own intervals, the
intervals widen with the noise, descheduled steps barely move it, and the noise check fires
above the requested precision and not below."""
from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest

from vmemkv.scheduler.profile_cost import FITTED, ProfileCost, step_features
from vmemkv.scheduler.profile_fit import (design_points, fit_coefficients, fit_profile,
                                          fit_steps,
                                          grouped_medians, median_half_widths, median_rank, nnls,
                                          repeats_for, robust_fit, shape_precisions)

TRUTH = dict(base_s=1.2e-3, per_seq_s=2e-5, per_new_token_s=6e-5, per_context_token_s=4e-7,
             per_prefill_pair_s=8e-8, per_step_token_sq_s=1e-8, per_prefill_step_s=3e-4,
             per_cold_step_s=5e-4, per_idle_wake_s=8e-4)
# calibrate's shapes, smaller: (batch, prompt tokens, generated tokens, after idle)
SHAPES = ([(b, c, 8, 0) for b in (1, 4, 16) for c in (16, 64, 256)]
          + [(1, n, 1, i) for n in (32, 96, 192, 320, 448) for i in (0, 1)])


def shape_steps(batch, context, new_tokens, idle):
    """The steps calibrate times for a shape, as point dicts without seconds."""
    steps = [dict(batch=batch, new_tokens=batch * context, context_tokens=batch * context,
                  prefill_pairs=batch * context * (context - 1) // 2, cold_step=0,
                  after_idle=idle)]
    for k in range(1, new_tokens):
        steps.append(dict(batch=batch, new_tokens=batch, context_tokens=batch * (context + k),
                          prefill_pairs=0, cold_step=int(k <= 3), after_idle=0))
    return steps


def true_seconds(p):
    cost = ProfileCost(**TRUTH)
    return cost.step_seconds(p["context_tokens"], p["new_tokens"], 0, p["batch"],
                             p["prefill_pairs"], bool(p["cold_step"]), bool(p["after_idle"]))


def synthetic(repeats, noise, seed=0, outliers=0.0):
    """Timed points of ``repeats`` rounds: each step's true time x lognormal(0, ``noise``), and
    with probability ``outliers`` x 3 (a descheduled step)."""
    rng = np.random.default_rng(seed)
    points = []
    for r, (s, shape) in itertools.product(range(repeats), enumerate(SHAPES)):
        for p in shape_steps(*shape):
            slow = 3.0 if rng.random() < outliers else 1.0
            points.append({**p, "shape": s, "repeat": r,
                           "seconds": true_seconds(p) * slow * rng.lognormal(0.0, noise)})
    return points


def test_step_features_are_the_terms_step_seconds_charges():
    for p in shape_steps(4, 64, 6, 1):
        assert np.dot([TRUTH[k] for k in FITTED], step_features(
            p["batch"], p["new_tokens"], p["context_tokens"], p["prefill_pairs"],
            p["cold_step"], p["after_idle"])) == pytest.approx(true_seconds(p), rel=1e-12)


def test_exact_data_gives_the_coefficients_back():
    got = fit_coefficients(design_points(synthetic(repeats=1, noise=0.0)))
    assert fit_steps(design_points(synthetic(repeats=1, noise=0.0))) == \
        pytest.approx(got, rel=1e-6)
    for key, value in TRUTH.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_the_fit_recovers_noisy_coefficients_within_its_own_intervals():
    profile = fit_profile(synthetic(repeats=6, noise=0.05, seed=3, outliers=0.05),
                          precision=0.05, max_repeats=6, resamples=100)
    for key, value in TRUTH.items():
        lo, hi = profile["coefficient_intervals"][key]
        assert lo <= value <= hi, (key, lo, value, hi)
        assert lo <= profile["coefficients"][key] <= hi, key


def test_intervals_widen_with_the_noise():
    def widths(noise):
        iv = fit_profile(synthetic(repeats=6, noise=noise, seed=1), 0.05, 6,
                         resamples=60)["coefficient_intervals"]
        return np.array([iv[k][1] - iv[k][0] for k in FITTED])
    ratio = widths(0.10) / widths(0.01)
    assert np.median(ratio) > 5, ratio


def per_step_least_squares(points):
    rows = np.array([step_features(p["batch"], p["new_tokens"], p["context_tokens"],
                                   p["prefill_pairs"], p["cold_step"], p["after_idle"])
                     for p in points])
    seconds = np.array([p["seconds"] for p in points])
    return dict(zip(FITTED, robust_fit(rows, seconds, "ls", typical=seconds)))


def test_descheduled_steps_move_the_fit_far_less_than_least_squares_on_every_step():
    # the same calibration with a tenth of its steps descheduled (4x their time)
    points = synthetic(repeats=3, noise=0.02, seed=5)
    rng = np.random.default_rng(1)
    slow = [{**p, "seconds": p["seconds"] * (4 if rng.random() < 0.1 else 1)} for p in points]
    robust = [fit_coefficients(design_points(pts)) for pts in (points, slow)]
    plain = [per_step_least_squares(pts) for pts in (points, slow)]
    moved = {name: np.median([abs(b[k] - a[k]) / TRUTH[k] for k in FITTED])
             for name, (a, b) in (("robust", robust), ("plain", plain))}
    assert moved["robust"] < 0.02 and moved["plain"] > 2.5 * moved["robust"], moved


def test_nnls_is_the_best_non_negative_solution():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 4)), rng.normal(size=12)
    got = nnls(a.T @ a, a.T @ b)
    best = min((np.linalg.norm(a @ x - b), tuple(x)) for x in (
        _restricted(a, b, mask) for mask in itertools.product((0, 1), repeat=4)) if min(x) >= 0)
    assert (got >= 0).all() and np.linalg.norm(a @ got - b) == pytest.approx(best[0], rel=1e-9)


def _restricted(a, b, mask):
    x = np.zeros(a.shape[1])
    cols = np.flatnonzero(mask)
    if len(cols):
        x[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
    return x


def test_grouped_medians_are_each_groups_median():
    rng = np.random.default_rng(2)
    groups, values = rng.integers(0, 6, size=40), rng.normal(size=40)
    got = grouped_medians(groups, values, 7)
    for g in range(6):
        assert got[g] == pytest.approx(statistics.median(values[groups == g]))
    assert np.isnan(got[6])


def test_repeats_for_follows_the_medians_standard_error():
    # half-width 1.96 x 1.2533 x spread / sqrt(n) <= precision, and never under 6
    assert repeats_for(0.10, 0.05) == 25 and repeats_for(0.02, 0.05) == 6
    n = repeats_for(0.18, 0.05)
    assert 1.96 * 1.2533 * 0.18 / n ** 0.5 <= 0.05 < 1.96 * 1.2533 * 0.18 / (n - 1) ** 0.5


@pytest.mark.parametrize("n", [5, 6, 9, 12, 20])
def test_the_median_interval_covers_the_median_95_percent_of_the_time(n):
    # exact: the interval [x(k), x(n+1-k)] misses when fewer than k draws fall on one side
    k = median_rank(n)
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n if k else 0.0
    assert (coverage >= 0.95) == bool(k)
    if k and k < n // 2:
        wider = 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
        assert wider < 0.95                       # the narrowest that still covers 95%
    rng = np.random.default_rng(n)
    draws = rng.lognormal(0, 0.2, size=(4000, n))      # true median 1
    widths = median_half_widths(list(draws))
    if k:
        lo, hi = np.sort(draws)[:, k - 1], np.sort(draws)[:, n - k]
        assert np.mean((lo <= 1) & (1 <= hi)) >= 0.94
        assert np.isfinite(widths).all()
    else:
        assert np.isinf(widths).all()             # not bounded yet


def test_the_noise_warning_fires_above_the_precision_and_not_below():
    quiet = fit_profile(synthetic(repeats=6, noise=0.01, seed=6), 0.05, 6, resamples=20)["noise"]
    assert not quiet["noisy"] and "reached" in quiet["message"]
    assert quiet["spread"] == pytest.approx(0.01, rel=0.15)
    loud = fit_profile(synthetic(repeats=6, noise=0.15, seed=6), 0.05, 6, resamples=20)["noise"]
    assert loud["noisy"] and "too noisy" in loud["message"]
    assert loud["spread"] == pytest.approx(0.15, rel=0.15)
    # what the message promises: the repeats the 90th-percentile spread needs, and the cap's
    # reach, both stated
    assert loud["needed_repeats"] == repeats_for(loud["spread_p90"], 0.05) > 6
    assert loud["achieved"] > 0.05 and loud["outside"] > 0.1 * loud["design_points"]
    assert f"cap of 6 gives +-{loud['achieved']:.1%}" in loud["message"]


def test_too_few_repeats_to_bound_a_median_say_so():
    noise = fit_profile(synthetic(repeats=3, noise=0.01), 0.05, 3, resamples=20)["noise"]
    assert noise["noisy"] and "needs 6" in noise["message"] and noise["achieved"] is None


def test_each_shape_is_judged_by_its_own_design_points():
    points = synthetic(repeats=6, noise=0.0, seed=0)
    noisy_shape = 3
    rng = np.random.default_rng(1)
    points = [{**p, "seconds": p["seconds"] * (rng.lognormal(0, 0.3) if p["shape"] == noisy_shape
                                                else 1.0)} for p in points]
    dps = design_points(points)
    within = shape_precisions(dps, median_half_widths(dps.samples()))
    assert within[noisy_shape] > 0.05
    assert all(w == 0.0 for s, w in within.items() if s != noisy_shape)


def test_right_skewed_noise_does_not_pull_the_fit_below_the_typical_step():
    # lognormal(0, 0.5) noise: the median step is the true cost, the mean 13% above. A fit to
    # every step with residuals relative to each step's own time (an earlier version) pulled
    # the fit 27% below the medians; relative to the design point's median it does not
    points = synthetic(repeats=6, noise=0.5, seed=2)
    dps = design_points(points)
    own_time = robust_fit(dps.rows[dps.point_design], dps.seconds, "huber", typical=dps.seconds)
    fits = {"medians": fit_coefficients(dps), "steps": fit_steps(dps),
            "own time": dict(zip(FITTED, own_time))}
    ratio = {name: np.median(dps.rows @ np.array([f[k] for k in FITTED]) / dps.medians())
             for name, f in fits.items()}
    assert 0.95 < ratio["medians"] < 1.05 and 0.95 < ratio["steps"] < 1.15, ratio
    assert ratio["own time"] < 0.8, ratio


@pytest.mark.parametrize("repeats", [1, 2, 5])
def test_too_few_repeats_to_resample_give_no_interval(repeats):
    # one repeat: every bootstrap draw was the same data, a zero-width "interval" that by float
    # noise missed its own estimate; below 6 the draws are too few to bound a coefficient
    profile = fit_profile(synthetic(repeats=repeats, noise=0.05, seed=4), 0.05, repeats,
                          resamples=20)
    assert profile["coefficient_intervals"] == dict.fromkeys(FITTED)
    six = fit_profile(synthetic(repeats=6, noise=0.05, seed=4), 0.05, 6, resamples=20)
    assert all(lo <= six["coefficients"][k] <= hi
               for k, (lo, hi) in six["coefficient_intervals"].items())


def test_the_spread_is_counted_over_the_design_points_measured_more_than_once():
    # shape 0 timed twice, every other shape once: the spread is measured on shape 0's points
    points = [p for p in synthetic(repeats=2, noise=0.05, seed=5)
              if p["repeat"] == 0 or p["shape"] == 0]
    dps = design_points(points)
    twice = sum(len(s) >= 2 for s in dps.samples())
    assert 0 < twice < len(dps.rows)
    noise = fit_profile(points, 0.05, 2, resamples=20)["noise"]
    assert noise["measured"] == twice and noise["design_points"] == len(dps.rows)
    assert (f"median over the {twice} of {len(dps.rows)} design points measured more than once"
            in noise["message"])
