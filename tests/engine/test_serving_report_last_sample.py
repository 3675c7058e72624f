"""``EngineStats.serving`` ends an n > 1 request at its last sample's last token: it timed the
first sample only, so a request whose first sample stopped after 1 token and whose second ran
on reported the first's end as its E2EL and the run's duration (the output throughput 4.5x
too high in the case found)."""
from __future__ import annotations

from vmemkv.runtime.engine.outputs import CompletionOutput, RequestOutput, request_timings
from vmemkv.scheduler.report import serving_report


def _sample(index, times):
    return CompletionOutput(index=index, token_ids=list(range(len(times))), finish_reason="stop",
                            token_times_s=list(times))


def test_an_n2_request_ends_with_its_longest_sample():
    out = RequestOutput(request_id=0, prompt_token_ids=[1, 2, 3], arrival_s=10.0,
                        outputs=[_sample(0, [10.005]), _sample(1, [10.005, 10.01, 10.024])],
                        status="finished")
    (timing,) = request_timings([out])
    report = serving_report([timing])
    assert abs(report["mean_e2el_ms"] - 24.0) < 1e-6
    assert abs(report["duration"] - 0.024) < 1e-9
    assert report["total_output_tokens"] == 4
    assert abs(report["output_throughput"] - 4 / 0.024) < 1e-6
