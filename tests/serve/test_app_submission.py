"""What the routes hand their Submission, driven through the app in process (no socket, no
engine: a fake engine thread answers each request with two tokens at once): a streamed
request's Submission keeps no per-choice logprobs (they travel in the chunks), a JSON one
keeps them for its body."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import httpx
import pytest

from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.serve import app as app_module
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import Ended, Token
from vmemkv.runtime.serve.metrics import ServeMetrics

from ..engine.byte_tokenizer import byte_tokenizer

TOP = TokenLogprobs(65, -0.5, 1, ((65, -0.5), (66, -1.5)))


class TwoTokenEngineThread:
    """Answers every submitted request at once: tokens 65 and 66 ("AB"), with logprobs."""
    alive = True

    def __init__(self) -> None:
        self.submitted = []

    def submit(self, ids, params, sink, arrival_s, index=0) -> Future:
        self.submitted.append((list(ids), params))
        request_id = len(self.submitted)
        sink(Token(TokenEvent(request_id, 0, 65, False, text="A", logprobs=TOP), 0.0))
        sink(Token(TokenEvent(request_id, 0, 66, True, "length", "B", logprobs=TOP), 0.0))
        sink(Ended("finished"))
        future: Future = Future()
        future.set_result(request_id)
        return future

    def abort(self, request_id) -> None:
        pass


def post(path: str, body: dict, monkeypatch):
    """(the response, the Submissions the app made) for ``body`` posted to ``path``."""
    made = []

    class Recorded(app_module.Submission):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(app_module, "Submission", Recorded)
    served = ServedModel("m", byte_tokenizer(chat_template=True), 256, 64, 8)
    app = create_app(TwoTokenEngineThread(), ServeMetrics("m"), served)

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
