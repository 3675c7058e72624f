"""profile_fit called directly on timed steps it cannot fit (hunt 30): a ConfigError naming
what is wrong, not a numpy error, nor a fit whose errors come out negative or NaN."""
import math

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_fit import coefficient_intervals, design_points, fit_profile


def step(seconds, batch=1, repeat=0):
    return dict(batch=batch, new_tokens=batch, context_tokens=8 * batch, prefill_pairs=0,
                cold_step=0, after_idle=0, shape=0, repeat=repeat, seconds=seconds)


def test_no_timed_steps_is_refused_by_name():
    with pytest.raises(ConfigError, match="needs timed steps: points is empty"):  # numpy's
        fit_profile([], precision=0.05, max_repeats=12)        # "zero-size array" before


@pytest.mark.parametrize("bad", [0.0, -1e-3, math.nan, math.inf, True])
def test_a_step_whose_seconds_is_not_a_positive_finite_number_is_refused_naming_it(bad):
    # -1e-3 gave median_rel_error -0.5, NaN gave NaN errors (written into the profile as NaN)
    points = [step(1e-3), step(2e-3, batch=2), step(bad, batch=3)]
    with pytest.raises(ConfigError, match=r"points\[2\]\.seconds must be a finite number of "
                                          r"seconds > 0, got"):
        fit_profile(points, precision=0.05, max_repeats=12)


@pytest.mark.parametrize("resamples", [0, -5, 2.5])
def test_resamples_below_one_is_refused_by_name(resamples):
    dps = design_points([step(1e-3 * (1 + 0.01 * r), repeat=r) for r in range(6)])
    with pytest.raises(ConfigError, match="resamples must be an int >= 1"):   # an IndexError
        coefficient_intervals(dps, dict.fromkeys(("base_s",), 1e-3), resamples=resamples)
