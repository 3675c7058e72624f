"""Pins of what a mutation audit of the server (2026-12-07) found unpinned, on its pure parts (no
server, no engine): each request limit at its bound (taken) and one past it (a 400 naming the
field), what a parsed request hands the engine, the response-size bound at the limit and its
streamed envelopes, and /metrics' buckets (Prometheus' ``le`` is inclusive), TTFT (the first
sample's first token), E2E (the last sample's last token), finished_reason and token counters."""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.engine.sampling import MAX_STOP_STRINGS
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.limits import (MAX_JSON_DEPTH, ResponseSize, TokenBytes,
                                         check_response_bytes, loads_json)
from vmemkv.runtime.serve.logprobs_format import echo_offsets
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.protocol import envelope, parse_completion_request, sse, usage
from vmemkv.runtime.serve.response_bounds import CHUNK_ID, chunk_envelope_bytes, stream_bound

from ..engine.byte_tokenizer import byte_tokenizer


def parsed(**fields):
    return parse_completion_request(json.dumps({"prompt": [1, 2], **fields}).encode())


def refused(**fields) -> ApiError:
    with pytest.raises(ApiError) as error:
        parsed(**fields)
    assert error.value.status == 400
    return error.value


def test_stop_takes_its_most_strings_and_refuses_one_more_or_an_empty_one():
    most = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert parsed(stop=most).stop_strings() == most
    assert refused(stop=most + ["one-more"]).param == "stop"
    assert refused(stop=["fine", ""]).param == "stop"      # it would match everywhere


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_nests_to_its_limit_and_one_level_more_is_refused():
    assert loads_json(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(ApiError) as error:
        loads_json(nested(MAX_JSON_DEPTH + 1))
    assert error.value.status == 400 and f"deeper than {MAX_JSON_DEPTH}" in error.value.message


def test_prompt_logprobs_are_asked_for_only_with_echo():
    assert parsed(logprobs=2).sampling_params().prompt_logprobs is None
    assert parsed(logprobs=2, echo=True).sampling_params().prompt_logprobs == 2
    assert parsed(logprobs=2).sampling_params().logprobs == 2


def test_top_k_minus_one_means_every_token():
    assert parsed(top_k=-1).sampling_params().top_k == parsed().sampling_params().top_k == 0


def test_usage_totals_prompt_and_completion_tokens():
    assert usage(7, 5) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_metrics_count_a_request_in_the_bucket_its_latency_equals_and_any_length_as_length():
    metrics = ServeMetrics("m")
    # sample 0: first token at 0.5 s, last at 1.0 s; sample 1: 0.75 s, then 2.5 s (binary-exact)
    metrics.observe_request(0.0, {0: [0.5, 1.0], 1: [0.75, 2.5]}, 5, "finished",
                            ["length", "stop"])
    metrics.observe_request(0.0, {0: [0.25]}, 3, "aborted", [])
    text = metrics.render()

    def sample(series: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(f"vmemkv:{series} ")]
        return float(line.split()[-1])
    labels = 'model_name="m"'
    assert sample(f'time_to_first_token_seconds_bucket{{{labels},le="0.25"}}') == 0
    assert sample(f'time_to_first_token_seconds_bucket{{{labels},le="0.5"}}') == 1   # the first
    assert sample(f'time_to_first_token_seconds_sum{{{labels}}}') == 0.5
    assert sample(f'e2e_request_latency_seconds_bucket{{{labels},le="2.0"}}') == 0   # the last
    assert sample(f'e2e_request_latency_seconds_bucket{{{labels},le="2.5"}}') == 1
    assert sample(f'time_per_output_token_seconds_bucket{{{labels},le="0.5"}}') == 1  # 0.5 s
    assert sample(f'time_per_output_token_seconds_bucket{{{labels},le="2.5"}}') == 2  # 1.75 s
    assert sample(f'time_per_output_token_seconds_count{{{labels}}}') == 2
    assert sample(f'request_success_total{{{labels},finished_reason="length"}}') == 1
    assert sample(f'request_success_total{{{labels},finished_reason="stop"}}') == 0
    assert sample(f'num_aborted_requests_total{{{labels}}}') == 1
    assert sample(f'prompt_tokens_total{{{labels}}}') == 8          # the aborted one's too
    assert sample(f'generation_tokens_total{{{labels}}}') == 5


def test_a_response_estimated_at_the_limit_is_taken_and_one_byte_more_is_refused():
    size = ResponseSize(prompts=2, n=3, max_tokens=5, logprobs=None)
    assert size.estimate_bytes == 3 * 2 * 5 * 16
    check_response_bytes(size, size.estimate_bytes)                    # at the limit: taken
    with pytest.raises(ApiError) as error:
        check_response_bytes(size, size.estimate_bytes - 1)
    assert error.value.status == 400 and error.value.param == "n"     # 2 choices fit
    assert "n 2 or less fits" in error.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_a_streamed_bound_counts_the_first_and_usage_chunks_envelopes(chat):
    kind = "chat.completion.chunk" if chat else "text_completion"
    envelope_bytes = chunk_envelope_bytes(kind, "m")
    assert envelope_bytes == len(sse(envelope(CHUNK_ID, kind, "m", 2**63 - 1, [])).encode())
    bound = TokenBytes(token_bytes=10, choice_bytes=100, envelope_bytes=1000)
    streamed = stream_bound(bound, chat, "m")
    assert streamed.envelope_bytes == 1000 + 2 * envelope_bytes       # once a response
    assert streamed.token_bytes == 10 + envelope_bytes + 100 + 1      # each token its chunk


def test_an_echoed_prompts_offsets_never_pass_the_echo():
    # the prompt as sent ("Hel") shorter than its ids decoded ("Hello": a tokenizer's
    # normalizer may make them differ): each offset stays within [0, len(echo)]
    ids = list(b"Hello")
    assert echo_offsets(byte_tokenizer(), ids, "Hel") == [0, 1, 2, 3, 3]
    assert echo_offsets(byte_tokenizer(), ids, "Hello") == [0, 1, 2, 3, 4]
    assert echo_offsets(None, [7, 42], "7 42 ") == [0, 2]    # no tokenizer: ids and a space
