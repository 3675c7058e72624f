"""A request's response is bounded before it is queued (``--max-response-bytes``, limits.py):
a 272-byte body (32 one-token prompts, n 8, max_tokens 255, logprobs 20, echo) made the server
build a 36 MB response and grow by 260 MiB; at the defaults one ~3 KB body could ask for ~8 GiB.
The limit itself is checked against the host's available memory at start (faked here), and a
stream keeps no logprobs once they are sent."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from vmemkv.cli import build_parser, main
from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve import Server, limits
from vmemkv.runtime.serve.engine_thread import Ended, EngineThread, Token
from vmemkv.runtime.serve.errors import ApiError, ServeConfigError
from vmemkv.runtime.serve.limits import (DEFAULT_MAX_RESPONSE_BYTES, ResponseSize, ServeLimits,
                                         check_response_bytes)
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.submission import Submission, response_size

from . import local_http
from .conftest import VMEM, assert_memory_at_baseline, model, serving

MiB = 2**20


def test_the_default_limit_is_64_mib_in_the_limits_and_the_cli():
    assert DEFAULT_MAX_RESPONSE_BYTES == 64 * MiB == ServeLimits().max_response_bytes
    assert build_parser().parse_args(["serve"]).max_response_bytes == 64 * MiB
    assert build_parser().parse_args(["serve", "--max-response-bytes", "1MiB"]) \
        .max_response_bytes == MiB


def test_a_small_body_asking_for_a_huge_response_is_400_naming_logprobs_and_nothing_is_queued():
    # 100 one-token prompts x n 8 x (60 tokens + the echoed prompt) x 21 logprob entries:
    # 8 x 6,100 tokens x 1,743 bytes (no tokenizer: 16 + 47 + 21 x 80) + 800 choices x 256
    # + 1,024 = 85,264,224 bytes, past the default 67,108,864
    body = {"prompt": [[i % 200 + 1] for i in range(100)], "n": 8, "max_tokens": 60,
            "logprobs": 20, "echo": True, "ignore_eos": True}
    with serving(VMEM) as (server, engine):
        got = local_http.post(server.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 400
        error = got.json()["error"]
        assert error["param"] == "logprobs"
        assert "85,264,224 bytes" in error["message"]
        assert "limit of 67,108,864 bytes (--max-response-bytes)" in error["message"]
        assert error["message"].endswith("logprobs 15 or less fits")   # 16 x 80 + 63 a token
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)
        normal = local_http.post(server.url + "/v1/completions", timeout=60,
                                 json={"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 20})
        assert normal.status_code == 200
        choice = normal.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["top_logprobs"]) == 4
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("size, limit_bytes, chat, param, fits", [
    # logprobs 20 -> 12: 8 x 60 x (16 + 13 x 80) = 506,880 <= 524,288
    (ResponseSize(1, 8, 60, 20), 524_288, True, "top_logprobs", "top_logprobs 12 or less fits"),
    (ResponseSize(1, 1, 1_000, 0), 20_000, False, "logprobs", "it fits without logprobs"),
    # no logprobs: 16 bytes a token; one choice of 4 x 1,000 tokens is 64,000 bytes
    (ResponseSize(4, 8, 1_000, None), 100_000, False, "n", "n 1 or less fits"),
    (ResponseSize(1, 1, 1_000, None), 8_000, True, "max_tokens",
     "max_tokens (or max_completion_tokens) 500 or less fits"),
    (ResponseSize(1_000, 1, 1, None), 8_000, False, "prompt", "send fewer prompts at a time"),
    # 1,000 echoed prompt tokens alone pass 10,000 bytes, even without logprobs
    (ResponseSize(1, 1, 10, 0, echo_tokens=1_000), 10_000, False, "prompt", "shorter ones"),
])
def test_the_refusal_names_the_field_to_lower_and_what_of_it_fits(size, limit_bytes, chat,
                                                                    param, fits):
    with pytest.raises(ApiError) as refused:
        check_response_bytes(size, limit_bytes, chat)
    assert refused.value.status == 400 and refused.value.param == param
    assert fits in refused.value.message
    assert f"{size.estimate_bytes:,} bytes" in refused.value.message
    check_response_bytes(size, size.estimate_bytes, chat)      # at the limit exactly: served


def test_what_bounds_a_response_counts_choices_beams_and_echoed_prompts():
    echo = SamplingParams(n=3, max_new_tokens=5, logprobs=2, prompt_logprobs=2)
    assert response_size([[1, 2], [3]], echo) == ResponseSize(2, 3, 5, 2, echo_tokens=3)
    assert response_size([[1, 2], [3]], SamplingParams(n=3, max_new_tokens=5)) \
        == ResponseSize(2, 3, 5, None)
    beams = BeamSearchParams(beam_width=4, max_new_tokens=10, num_return_beams=2)
    assert response_size([[1, 2], [3]], beams) == ResponseSize(2, 2, 10, None)
    assert ResponseSize(2, 3, 5, 2, echo_tokens=3).estimate_bytes == 3 * 13 * (16 + 3 * 80)


def test_a_limit_past_available_memory_is_refused_at_start(monkeypatch, capsys):
    monkeypatch.setattr(limits, "meminfo_bytes", lambda field: 1024 * MiB)
    with pytest.raises(ServeConfigError, match=r"max_response_bytes 536870912 .*about "
                       r"2147483648 bytes \(4 x\), more than the host MemAvailable of "
                       r"1073741824 bytes; lower it to at most 268435456"):
        ServeLimits(max_response_bytes=512 * MiB)
    assert ServeLimits(max_response_bytes=256 * MiB).max_response_bytes == 256 * MiB
    with pytest.raises(ServeConfigError, match="max_response_bytes must be an int >= 1, got 0"):
        ServeLimits(max_response_bytes=0)
    code = main(["serve", "--max-response-bytes", "512MiB", "--port", "0", "--log-level",
                 "critical"])      # refused before the model loads
    err = capsys.readouterr().err
    assert code == 2 and "ServeConfigError: max_response_bytes 536870912 (--max-response-bytes)" \
        in err


class _FakeEngineThread:
    """Takes submissions (their sinks kept), never runs them."""

    def __init__(self, max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.sinks = []
        self.max_response_bytes, self.response_budget = max_response_bytes, None

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        self.sinks.append(sink)
        future: Future = Future()
        future.set_result(len(self.sinks))
        return future

    def abort(self, request_id) -> None:
        pass


def test_a_submission_is_refused_before_anything_is_submitted():
    async def submit(server, max_new_tokens):
        return Submission(server, [[1, 2]], SamplingParams(max_new_tokens=max_new_tokens,
                                                           logprobs=20), 0.0)
    server = _FakeEngineThread(max_response_bytes=1_000)      # the server's limit
    with pytest.raises(ApiError) as refused:
        asyncio.run(submit(server, 1))                        # 1,696 bytes
    assert refused.value.param == "logprobs" and server.sinks == []
    default = _FakeEngineThread()                             # the default: 64 MiB
    with pytest.raises(ApiError):
        asyncio.run(submit(default, 40_000))                  # 67,840,000 bytes
    assert default.sinks == []
    asyncio.run(submit(default, 39_000))                      # 66,144,000 bytes
    assert len(default.sinks) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_stream_keeps_no_logprobs_once_they_are_sent(stream):
    top = TokenLogprobs(5, -0.5, 1, ((5, -0.5), (6, -1.5)))

    async def run():
        server = _FakeEngineThread()
        submission = Submission(server, [[1, 2]], SamplingParams(max_new_tokens=2, logprobs=2),
                                0.0, stream=stream)
        await submission.started()
        server.sinks[0](Token(TokenEvent(1, 0, 5, False, logprobs=top), 0.0))
        server.sinks[0](Token(TokenEvent(1, 0, 6, True, "length", logprobs=top), 0.0))
        server.sinks[0](Ended("finished"))
        return [delta async for delta in submission.events()], submission.choices[0]

    deltas, choice = asyncio.run(run())
    assert [d.logprobs for d in deltas] == [[top], [top]]     # every token's are sent
    assert choice.token_ids == [5, 6] and choice.finish_reason == "length"
    assert choice.logprobs == ([] if stream else [top, top])


def test_the_engine_thread_declares_the_response_limit_and_budget_each_submission_reads():
    # a Submission read them with getattr and a default, so a server that never set them
    # and one that set them were alike to it; they are now the engine thread's own
    bare = EngineThread(engine=None, metrics=ServeMetrics("m"))
    assert bare.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES and bare.response_budget is None
    with Engine(model(), None, **VMEM) as engine:
        server = Server(engine, "m", port=0, limits=ServeLimits(max_response_bytes=MiB),
                        max_response_memory_bytes=3 * MiB)        # built, never started
        assert server.engine_thread.max_response_bytes == MiB
        assert server.engine_thread.response_budget.total_bytes == 3 * MiB
