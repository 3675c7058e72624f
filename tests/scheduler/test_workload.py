"""Workload generation and JSONL traces."""
import json
import math

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.metrics import percentile
from vmemkv.scheduler.workload import (TraceEntry, WorkloadSpec, generate, lognormal_from_mean_p95,
                                lognormal_from_median_p95, write_trace)
from vmemkv.scheduler.traces import load_trace

UNCLIPPED = dict(num_requests=20_000, max_total_len=10**9, seed=7)


def test_prompt_median_and_p95_match_the_spec():
    prompts = [e.prompt_len for e in generate(WorkloadSpec(**UNCLIPPED))]
    assert percentile(prompts, 50) == pytest.approx(584, rel=0.04)
    assert percentile(prompts, 95) == pytest.approx(2155, rel=0.06)


def test_output_mean_and_p95_match_the_spec():
    outputs = [e.output_len for e in generate(WorkloadSpec(**UNCLIPPED))]
    assert sum(outputs) / len(outputs) == pytest.approx(374, rel=0.04)
    assert percentile(outputs, 95) == pytest.approx(1118, rel=0.06)


def test_mean_p95_solver_satisfies_both_equations():
    mu, sigma = lognormal_from_mean_p95(374, 1118)
    assert mu + sigma**2 / 2 == pytest.approx(math.log(374))
    assert mu + 1.6448536 * sigma == pytest.approx(math.log(1118))
    assert 0 < sigma < 1.6448536     # the smaller, sensible root


def test_median_p95_solver():
    mu, sigma = lognormal_from_median_p95(584, 2155)
    assert math.exp(mu) == pytest.approx(584)
    assert sigma == pytest.approx((math.log(2155) - math.log(584)) / 1.6448536)


@pytest.mark.parametrize("mean,p95", [(374, 300), (100, 10_000), (0, 5)])
def test_impossible_output_distribution_is_a_config_error(mean, p95):
    with pytest.raises(ConfigError, match="mean"):
        WorkloadSpec(output_mean=mean, output_p95=p95)


def test_lengths_are_clipped_to_max_total_len_and_positive():
    for e in generate(WorkloadSpec(num_requests=3000, max_total_len=1024, seed=3)):
        assert e.prompt_len >= 1 and e.output_len >= 1
        assert e.total_len <= 1024


def test_same_seed_same_workload_other_seed_differs():
    assert generate(WorkloadSpec(num_requests=50, seed=1)) == generate(WorkloadSpec(num_requests=50, seed=1))
    assert generate(WorkloadSpec(num_requests=50, seed=1)) != generate(WorkloadSpec(num_requests=50, seed=2))


def test_default_arrivals_are_all_at_time_zero():
    assert {e.arrival_s for e in generate(WorkloadSpec(num_requests=100))} == {0.0}


def test_poisson_arrivals_are_sorted_with_the_requested_rate():
    arrivals = [e.arrival_s for e in generate(WorkloadSpec(num_requests=5000, arrival_rate=20.0))]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 20.0, rel=0.06)


def test_trace_round_trip(tmp_path):
    entries = generate(WorkloadSpec(num_requests=200, arrival_rate=5.0, seed=11))
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), entries)
    assert load_trace(str(path)) == entries


def test_trace_skips_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 3, "output_len": 4, "arrival_s": 0}\n\n{"prompt_len": 1, "output_len": 1, "arrival_s": 0.5}\n')
    assert load_trace(str(path)) == [TraceEntry(3, 4, 0.0), TraceEntry(1, 1, 0.5)]


@pytest.mark.parametrize("bad", [
    "not json",
    "[1, 2]",
    '{"output_len": 4}',
    '{"prompt_len": 0, "output_len": 4}',
    '{"prompt_len": 3, "output_len": true}',
    '{"prompt_len": 3.5, "output_len": 4}',
    '{"prompt_len": 3, "output_len": 4, "arrival_s": -1}',
    '{"prompt_len": 3, "output_len": 4, "arrival_s": "soon"}',
])
def test_bad_trace_line_is_a_config_error_naming_the_line(tmp_path, bad):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_len": 2, "output_len": 2, "arrival_s": 0}) + "\n" + bad + "\n")
    with pytest.raises(ConfigError, match="line 2"):
        load_trace(str(path))


def test_empty_trace_is_a_config_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(str(path))
