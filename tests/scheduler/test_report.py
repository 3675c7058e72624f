"""The serving report (vllm bench serve's metrics), checked against hand-computed figures."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.report import RequestTiming, parse_goodput, serving_report

# request A: arrives 0, tokens at 1.0, 1.5, 2.0 -> ttft 1000 ms, tpot 500, itl 500/500, e2el 2000
# request B: arrives 1, one token at 4.0       -> ttft 3000 ms, no tpot, e2el 3000
A = RequestTiming(0.0, (1.0, 1.5, 2.0), prompt_tokens=10)
B = RequestTiming(1.0, (4.0,), prompt_tokens=30)


def test_hand_computed_two_request_report():
    r = serving_report([A, B])
    assert r["completed"] == 2 and r["duration"] == 4.0
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (40, 4)
    assert r["request_throughput"] == 0.5
    assert r["output_throughput"] == 1.0 and r["total_token_throughput"] == 11.0
    assert (r["mean_ttft_ms"], r["median_ttft_ms"]) == (2000.0, 2000.0)
    assert r["p90_ttft_ms"] == pytest.approx(2800.0)
    assert r["mean_tpot_ms"] == 500.0 and r["std_tpot_ms"] == 0.0
    assert r["mean_itl_ms"] == 500.0 and r["p99_itl_ms"] == 500.0
    assert r["mean_e2el_ms"] == 2500.0


def test_goodput_counts_requests_meeting_every_target_and_one_token_tpot_is_zero():
    assert serving_report([A, B], goodput_ms={"ttft": 1500})["request_goodput"] == 0.25
    assert serving_report([A, B], goodput_ms={"tpot": 100})["request_goodput"] == 0.25
    assert serving_report([A, B], goodput_ms={"ttft": 5000, "e2el": 5000})["request_goodput"] == 0.5
    assert "request_goodput" not in serving_report([A, B])


def test_requests_without_tokens_are_not_completed_and_an_empty_report_is_nan():
    r = serving_report([RequestTiming(0.0, (), 5)])
    assert r["completed"] == 0 and math.isnan(r["mean_ttft_ms"]) and math.isnan(r["request_throughput"])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.lists(st.floats(0.001, 5), min_size=1, max_size=6)),
                min_size=1, max_size=20),
       st.floats(0, 100))
def test_percentiles_and_means_equal_numpys(rows, q):
    timings = []
    for arrival, gaps in rows:
        times = tuple(arrival + float(c) for c in np.cumsum(gaps))
        timings.append(RequestTiming(arrival, times, 1))
    r = serving_report(timings, percentiles=(q,))
    ttft = np.array([t.ttft_s for t in timings]) * 1e3
    assert r[f"p{q:g}_ttft_ms"] == pytest.approx(np.percentile(ttft, q))
    assert r["mean_ttft_ms"] == pytest.approx(ttft.mean())
    itl = np.array([g for t in timings for g in t.itl_s()]) * 1e3
    if itl.size:
        assert r["median_itl_ms"] == pytest.approx(np.median(itl))


def test_parse_goodput_reads_the_flag_and_refuses_bad_items():
    assert parse_goodput(["ttft:2000", "tpot:200"]) == {"ttft": 2000.0, "tpot": 200.0}
    for bad, match in (("ttft", "METRIC:MS"), ("itl:5", "METRIC:MS"), ("ttft:-1", "> 0"),
                       ("tpot:fast", "> 0")):
        with pytest.raises(ConfigError, match=match):
            parse_goodput([bad])


@pytest.mark.parametrize("kwargs", [{"percentiles": (101,)}, {"duration_s": -1.0}])
def test_bad_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        serving_report([A], **kwargs)


def test_mean_median_and_std_match_numpy_on_many_samples():
    rng = np.random.default_rng(5)
    gaps = rng.exponential(0.01, 20_001)
    times = tuple(np.cumsum(gaps))
    r = serving_report([RequestTiming(0.0, times, 10)])
    itl_ms = np.diff(times) * 1e3
    assert r["mean_itl_ms"] == pytest.approx(itl_ms.mean())
    assert r["median_itl_ms"] == pytest.approx(np.median(itl_ms))
    assert r["std_itl_ms"] == pytest.approx(itl_ms.std())
