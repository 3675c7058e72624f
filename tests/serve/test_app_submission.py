"""What the routes hand their Submission, driven through the app in process (no socket, no
engine: a fake engine thread answers each request with two tokens at once): a streamed
request's Submission keeps no per-choice logprobs (they travel in the chunks), a JSON one
keeps them for its body; an echoed prompt counts against --max-response-bytes with or
without logprobs."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import httpx
import pytest

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve import app as app_module
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import Ended, Token
from vmemkv.runtime.serve.limits import DEFAULT_MAX_RESPONSE_BYTES, ResponseSize
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.submission import response_size

from ..engine.byte_tokenizer import byte_tokenizer

TOP = TokenLogprobs(65, -0.5, 1, ((65, -0.5), (66, -1.5)))


def finished(sink, request_id: int) -> Future:
    """A fake engine thread's end of a request it has sent every token of: ``Ended`` to its
    sink, and the submission's future done with its id."""
    sink(Ended("finished"))
    future: Future = Future()
    future.set_result(request_id)
    return future


class TwoTokenEngineThread:
    """Answers every submitted request at once: tokens 65 and 66 ("AB"), with logprobs."""
    alive = True

    def __init__(self) -> None:
        self.submitted = []
        self.max_response_bytes, self.response_budget = DEFAULT_MAX_RESPONSE_BYTES, None

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        self.submitted.append((list(ids), params))
        request_id = len(self.submitted)
        sink(Token(TokenEvent(request_id, 0, 65, False, text="A", logprobs=TOP), 0.0))
        sink(Token(TokenEvent(request_id, 0, 66, True, "length", "B", logprobs=TOP), 0.0))
        return finished(sink, request_id)

    def abort(self, request_id) -> None:
        pass


def post(path: str, body: dict, monkeypatch, engine_thread=None, max_sequence_tokens=64):
    """(the response, the Submissions the app made) for ``body`` posted to ``path``."""
    made = []

    class Recorded(app_module.Submission):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(app_module, "Submission", Recorded)
    served = ServedModel("m", byte_tokenizer(chat_template=True), 256, max_sequence_tokens, 8)
    app = create_app(engine_thread or TwoTokenEngineThread(), ServeMetrics("m"), served)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=10)

    return asyncio.run(run()), made


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_streamed_requests_submission_keeps_no_logprobs(path, body, stream, monkeypatch):
    got, made = post(path, {**body, "stream": stream}, monkeypatch)
    assert got.status_code == 200
    (submission,) = made
    (choice,) = submission.choices
    assert choice.token_ids == [65, 66] and choice.text == "AB"
    assert choice.logprobs == ([] if stream else [TOP, TOP])
    if stream:      # every token's logprobs were sent all the same, in its chunk
        chunks = [json.loads(line[len("data: "):]) for line in got.text.splitlines()
                  if line.startswith("data: {")]
        sent = [c["choices"][0]["logprobs"] for c in chunks
                if c["choices"] and c["choices"][0]["logprobs"] is not None]
        assert len(sent) == 2
    else:
        assert got.json()["choices"][0]["logprobs"] is not None


def test_echo_without_logprobs_counts_each_choices_prompt_against_the_limit(monkeypatch):
    # 16 prompts x 1,000 ids, n 8, max_tokens 1, echo: 8 x (16 x 1 + 16,000) x 11 bytes (the
    # byte tokenizer's bound) + 128 choices x 256 + 1,024 = 1,443,200 bytes (the real answer was
    # 467,688 bytes); echo was not counted without logprobs, so it was estimated at 2,048 bytes
    # and served under a 64 KiB limit
    engine_thread = TwoTokenEngineThread()
    engine_thread.max_response_bytes = 64 * 1024
    body = {"prompt": [[1 + i % 250 for i in range(1000)]] * 16, "n": 8, "max_tokens": 1,
            "echo": True}
    got, made = post("/v1/completions", body, monkeypatch, engine_thread, 2048)
    assert got.status_code == 400 and made == [] and engine_thread.submitted == []
    error = got.json()["error"]
    assert error["param"] == "prompt"
    assert "about 1,443,200 bytes" in error["message"] and "16000 echoed" in error["message"]
    assert "limit of 65,536 bytes (--max-response-bytes)" in error["message"]
    body["echo"] = False          # 8 x 16 x 1 x 11 + 128 x 256 + 1,024 = 35,200 bytes: served
    got, made = post("/v1/completions", body, monkeypatch, engine_thread, 2048)
    assert got.status_code == 200 and len(engine_thread.submitted) == 16


def test_what_bounds_a_response_counts_an_echo_without_logprobs():
    assert response_size([[1, 2], [3]], SamplingParams(n=3, max_new_tokens=5), echo=True) \
        == ResponseSize(2, 3, 5, None, echo_tokens=3)
    assert ResponseSize(2, 3, 5, None, echo_tokens=3).estimate_bytes == 3 * 13 * 16
    beams = BeamSearchParams(beam_width=4, max_new_tokens=10, num_return_beams=2)
    assert response_size([[1, 2], [3]], beams, echo=True) == ResponseSize(2, 2, 10, None, 3)
    assert response_size([[1, 2], [3]], beams) == ResponseSize(2, 2, 10, None)
