"""The standard workload's documented recipe (seeded numpy) and the old draw kept as an option."""
import math

import numpy as np
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.workload import (WorkloadSpec, generate, lognormal_from_mean_p95,
                                       lognormal_from_median_p95, scale_to_length)


def recipe(n: int, seed: int, max_total: int, rate: float = 0.0):
    """docs/simulation.md's description, written out independently of workload.py."""
    rng = np.random.default_rng(seed)
    p_mu, p_sigma = math.log(584), (math.log(2155) - math.log(584)) / 1.6448536269514722
    o_mu, o_sigma = lognormal_from_mean_p95(374, 1118)
    prompts = [max(1, int(np.rint(x))) for x in rng.lognormal(p_mu, p_sigma, n)]
    outputs = [max(1, int(np.rint(x))) for x in rng.lognormal(o_mu, o_sigma, n)]
    gaps = rng.exponential(1 / rate, n) if rate else np.zeros(n)
    out = []
    for p, o, t in zip(prompts, outputs, np.cumsum(gaps)):
        if p + o > max_total:
            f = max_total / (p + o)
            p = min(max(1, round(p * f)), max_total - 1)
            o = max(1, min(round(o * f), max_total - p))
        out.append((p, o, float(t)))
    return out


@pytest.mark.parametrize("seed,max_total,rate", [(0, 4096, 0.0), (3, 1024, 5.0)])
def test_default_draw_is_the_documented_numpy_recipe(seed, max_total, rate):
    spec = WorkloadSpec(num_requests=500, seed=seed, max_total_len=max_total, arrival_rate=rate)
    got, want = generate(spec), recipe(500, seed, max_total, rate)
    assert [(e.prompt_len, e.output_len) for e in got] == [(p, o) for p, o, _ in want]
    assert [e.arrival_s for e in got] == pytest.approx([t for _, _, t in want])


def test_python_draw_is_the_workload_before_issue_13():
    entries = generate(WorkloadSpec(rng="python"))
    assert sum(e.prompt_len for e in entries) == 1_597_690
    assert sum(e.output_len for e in entries) == 730_973


def test_standard_workload_token_totals_are_pinned():
    entries = generate(WorkloadSpec())
    assert sum(e.prompt_len for e in entries) == 1_541_358
    assert sum(e.output_len for e in entries) == 746_172


def test_scaled_lengths_never_pass_the_max_total_len_and_keep_a_token_each():
    """Both rounded up could pass the limit (1 + 100 tokens into 2: 1 and round(1.98) = 2)."""
    assert scale_to_length(1, 100, 2) == (1, 1)
    for max_total_len in range(2, 12):
        for prompt_len in range(1, 30):
            for output_len in range(1, 30):
                p, o = scale_to_length(prompt_len, output_len, max_total_len)
                assert p >= 1 and o >= 1 and p + o <= max_total_len, (prompt_len, output_len)


def test_too_long_requests_are_scaled_in_proportion():
    assert scale_to_length(3000, 3000, 4096) == (2048, 2048)
    assert scale_to_length(9000, 1000, 1000) == (900, 100)
    assert scale_to_length(100, 20, 4096) == (100, 20)
    p, o = scale_to_length(10**6, 1, 100)
    assert (p, o) == (99, 1)


def test_scaled_lengths_fit_and_stay_positive():
    for e in generate(WorkloadSpec(num_requests=3000, max_total_len=512, seed=5)):
        assert e.prompt_len >= 1 and e.output_len >= 1 and e.total_len <= 512


def test_unknown_rng_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="rng"):
        WorkloadSpec(rng="mersenne")


def test_median_solver_matches_the_recipes_constant():
    assert lognormal_from_median_p95(584, 2155)[0] == pytest.approx(math.log(584))
