"""The engine's per-request token times and its serving report (report.py, wall seconds)."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.outputs import request_timings

from .conftest import model, prompts


@pytest.fixture(scope="module")
def run():
    batch = prompts(3, 5, 20, seed=4)
    with Engine(model(), max_batch=2, max_context=64) as engine:
        outs = engine.generate(batch, SamplingParams(max_new_tokens=5, ignore_eos=True))
        return outs, engine.last_stats


def test_every_token_has_a_time_after_its_arrival_in_order(run):
    outs, _ = run
    for out in outs:
        times = out.outputs[0].token_times_s
        assert len(times) == len(out.outputs[0].token_ids) == 5
        assert times == sorted(times) and times[0] > out.arrival_s


def test_stats_carry_the_shared_serving_report(run):
    outs, stats = run
    s = stats.serving
    assert s["completed"] == 3 and s["total_output_tokens"] == 15
    assert s["total_input_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert s["median_ttft_ms"] > 0 and s["p99_itl_ms"] >= s["median_itl_ms"] > 0
    assert stats.as_dict()["mean_tpot_ms"] == s["mean_tpot_ms"]


def test_request_timings_are_one_per_request(run):
    outs, _ = run
    timings = request_timings(outs)
    assert [t.output_tokens for t in timings] == [5, 5, 5]
    assert [t.arrival_s for t in timings] == [o.arrival_s for o in outs]


def test_a_request_of_n_samples_counts_once_with_every_samples_tokens():
    """It counted n requests and its prompt n times (request_throughput 3x too high at n=3)."""
    prompt = prompts(1, 20, 20, seed=5)[0]
    with Engine(model(), max_batch=4, max_context=64) as engine:
        (out,) = engine.generate([prompt], SamplingParams(n=3, max_new_tokens=5, temperature=1.0,
                                                          seed=3, ignore_eos=True))
        s = engine.last_stats.serving
    assert len(out.outputs) == 3 and engine.last_stats.requests == 1
    assert s["completed"] == 1 and s["total_input_tokens"] == len(prompt) == 20
    assert s["total_output_tokens"] == sum(len(c.token_ids) for c in out.outputs) == 15
    (timing,) = request_timings([out])
    assert timing.token_times_s == tuple(out.outputs[0].token_times_s)
