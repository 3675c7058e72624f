"""The serving report refuses, by name, goodput targets, percentiles and durations it cannot
report exactly (an unknown metric was a KeyError; a NaN or negative target, or an infinite
duration, gave silently wrong figures; 99.99999 and 100 shared the key p100, one dropped)."""
import math
import socket

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.report import RequestTiming, serving_report

# arrives 0, tokens at 0.1, 0.3, 0.6: ttft 100 ms, tpot 250 ms, e2el 600 ms
TIMING = RequestTiming(0.0, (0.1, 0.3, 0.6), prompt_tokens=5)


@pytest.mark.parametrize("targets, message", [
    ({"itl": 5.0}, r"goodput target 'itl': the metric must be one of ttft, tpot, e2el"),
    ({"TTFT": 5.0}, r"goodput target 'TTFT'"),
    ({"ttft": math.nan}, r"goodput target ttft: milliseconds must be a finite number > 0, got nan"),
    ({"tpot": -1.0}, r"goodput target tpot: .* got -1.0"),
    ({"e2el": "600"}, r"goodput target e2el: .* got '600'"),
    (["ttft:100"], r"goodput_ms must map metric names to milliseconds, .* got list"),
])
def test_a_goodput_target_the_report_cannot_judge_is_refused_by_name(targets, message):
    with pytest.raises(ConfigError, match=message):
        serving_report([TIMING], goodput_ms=targets)


def test_an_infinite_duration_is_refused_not_reported_as_zero_throughput():
    with pytest.raises(ConfigError, match=r"duration_s must be finite and >= 0 seconds, got inf"):
        serving_report([TIMING], duration_s=math.inf)


def test_two_percentiles_one_key_would_name_are_refused():
    """99.99999 and 100 were both p100_*: one figure silently overwrote the other."""
    with pytest.raises(ConfigError, match=r"99.99999 and 100.0 would both be reported as p100"):
        serving_report([TIMING], percentiles=(99.99999, 100.0))
    r = serving_report([TIMING], percentiles=(99.9999, 100.0, 100))   # equal values: one key
    assert r["p99.9999_ttft_ms"] == r["p100_ttft_ms"] == 100.0


def test_bench_serve_refuses_two_percentiles_sharing_a_key_before_any_request(capsys, tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--rate", "1",
                 "--num-prompts", "1", "--percentiles", "99.99999", "100", "--no-plots", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--percentiles: 99.99999 and 100.0 would both be reported as p100" in err
    assert "cannot list the models" not in err


def test_a_request_ends_with_its_last_sequence_not_its_timed_one():
    """n=2, the timed sample stopped at its first token (5 ms) and the other ran to 24 ms:
    E2EL and duration ended at 5 ms, so output_throughput counted 8 tokens over 5 ms (4.8x)."""
    t = RequestTiming(0.0, (0.005,), prompt_tokens=8, other_output_tokens=7, last_token_s=0.024)
    r = serving_report([t], goodput_ms={"e2el": 20})
    assert t.e2el_s == r["mean_e2el_ms"] / 1e3 == r["duration"] == 0.024
    assert r["output_throughput"] == 8 / 0.024 and r["request_goodput"] == 0.0
    assert r["mean_ttft_ms"] == 5.0 and math.isnan(r["mean_tpot_ms"])   # the timed sample's
    early = RequestTiming(0.0, (0.1, 0.2), prompt_tokens=8, last_token_s=0.15)
    assert early.e2el_s == 0.2    # a last token before the timed sequence's own cannot end it
