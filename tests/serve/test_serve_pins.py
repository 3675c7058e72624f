"""Pins of the server's promises found unpinned by a mutation audit (2026-12-07), driven through
the app in process (no socket, no engine): a fake engine thread records what it is handed and
what is aborted.

* A client that disconnects before its JSON answer aborts every request of it (app.py).
* With ``--salt-per-key`` every request of a key carries that key's prefix-cache salt, a
  request's own ``cache_salt`` after it (auth.salted): on both routes and with beam search, so
  two tenants sending the same ``cache_salt`` still never share a prefix.
* Choice ``prompt * n + sample`` is sample ``sample`` of prompt ``prompt``, its echo that
  prompt's; usage counts every prompt's tokens and every choice's (submission.py).
* Chat's ``max_completion_tokens`` wins over the older ``max_tokens`` when both are sent.
* A streamed response is bounded with each token's chunk envelope: one the limit takes as
  JSON can be refused streamed (submission.py, response_bounds.py).
* A request whose handler is cancelled (the server's shutdown) as the engine thread queues it
  is aborted (app._respond).
* A prompt that fills the context alone is a 400 naming ``prompt``; one token less, the
  request's ``max_tokens`` is named (completions.ServedModel.check_lengths).
* ``min_tokens`` with stop ids that, with EOS, cover the vocabulary is a 400 naming it before
  anything is queued; with ``ignore_eos`` EOS is no stop id and it is taken.
* Without a tokenizer the echo is the prompt's ids in decimal, each followed by a space, and
  stop strings are a 400 naming ``stop`` (nothing could match them).
* An API key opens a route only as a Bearer token (any case of "Bearer"), never under another
  scheme.
* ``POST /resize`` while the engine sleeps is a 409 saying to wake it first (admin.py).
* A Content-Length past ``max_body_bytes`` is a 413 before a byte of the body is read; one at
  the limit reaches the app (auth.Guard).
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import httpx

from vmemkv.runtime.engine.errors import EngineSleepingError
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.auth import AuthConfig, Guard, key_salt
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import Token, choices_per_prompt
from vmemkv.runtime.serve.in_flight import RequestsInFlight
from vmemkv.runtime.serve.limits import (DEFAULT_MAX_RESPONSE_BYTES, ResponseBounds, ResponseSize,
                                         ServeLimits)
from vmemkv.runtime.serve.metrics import ServeMetrics

from ..engine.byte_tokenizer import byte_tokenizer
from .test_app_submission import finished


class SilentEngineThread:
    """Queues every request and never answers one: ``submitted`` (ids, params, key),
    ``aborted`` (request ids)."""
    alive = True

    def __init__(self) -> None:
        self.max_response_bytes, self.response_budget = DEFAULT_MAX_RESPONSE_BYTES, None
        self.submitted, self.aborted = [], []
        self.in_flight = RequestsInFlight(256)     # a key's requests are checked against it

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        self.submitted.append((list(ids), params, key))
        future: Future = Future()
        future.set_result(len(self.submitted))
        return future

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)


def answer_token(request_id: int, sample: int, i: int) -> int:
    """The fake engine's ``i``-th token of ``sample`` of request ``request_id`` (from 1): a
    character telling request, sample and position apart (65: "A")."""
    return 65 + 8 * (request_id - 1) + 3 * sample + i


class AnsweringEngineThread(SilentEngineThread):
    """Answers every request at once: each choice ``max_new_tokens`` tokens (``answer_token``),
    the last "length"."""

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        request_id = super().submit(ids, params, sink, arrival_s, index, key).result()
        for sample in range(choices_per_prompt(params)):
            for i in range(params.max_new_tokens):
                token_id, last = answer_token(request_id, sample, i), i == params.max_new_tokens - 1
                sink(Token(TokenEvent(request_id, sample, token_id, last,
                                      "length" if last else None, chr(token_id)), 0.0))
        return finished(sink, request_id)


def post(app, path: str, body: dict, key=None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            return await client.post(path, json=body, headers=headers, timeout=10)
    return asyncio.run(run())


def served_model(**fields) -> ServedModel:
    """A byte tokenizer's model (vocabulary 256) with a 64-token context, max_batch 8."""
    return ServedModel("m", byte_tokenizer(chat_template=True), 256, 64, 8, **fields)


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
            "headers": [(b"content-type", b"application/json")]}


async def _drive(app, path: str, body: dict, until):
    """``app``'s answer (its ASGI messages) to ``body`` posted to ``path``, the client
    disconnecting once ``until()`` holds (it is polled between the app's steps)."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        while not until():
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    sent = []

    async def send(message) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_scope(path), receive, send), 10)
    return sent


def test_a_client_gone_before_its_json_answer_aborts_every_request_of_it():
    thread = SilentEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model())
    body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "n": 2}
    sent = asyncio.run(_drive(app, "/v1/completions", body, lambda: len(thread.submitted) == 2))
    assert sent[0]["status"] == 499                       # nobody reads it
    assert sorted(thread.aborted) == [1, 2]               # both prompts' requests, each once


class QueueingEngineThread(SilentEngineThread):
    """Hands out futures the test resolves (``futures``: the engine thread not yet at them)."""

    def __init__(self) -> None:
        super().__init__()
        self.futures = []

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        super().submit(ids, params, sink, arrival_s, index, key)
        self.futures.append(Future())
        return self.futures[-1]


def test_a_request_cancelled_as_the_engine_queues_it_is_aborted():
    thread = QueueingEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model())
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()

    async def run() -> None:
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message) -> None:
            pass
        handler = asyncio.ensure_future(app(_scope("/v1/completions"), receive, send))
        while not thread.submitted:             # waiting in Submission.started()
            await asyncio.sleep(0)
        thread.futures[0].set_result(7)   # the engine thread queues it as request 7, and
        handler.cancel()                  # before the loop hears of it the handler is cancelled
        await asyncio.gather(handler, return_exceptions=True)
    asyncio.run(run())
    assert thread.aborted == [7]          # nobody waits for its tokens: its memory goes back


def test_with_salt_per_key_each_keys_requests_carry_its_salt_before_their_own():
    thread = AnsweringEngineThread()
    auth = AuthConfig(("key-a", "key-b"), salt_per_key=True)
    app = Guard(create_app(thread, ServeMetrics("m"), served_model()), ServeLimits(), auth)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cmpl = {"prompt": [1, 2, 3], "max_tokens": 2}
    beam = {**cmpl, "use_beam_search": True, "n": 2}
    sent = [("/v1/completions", cmpl), ("/v1/chat/completions", chat), ("/v1/completions", beam)]
    for key in ("key-a", "key-b"):
        for path, body in sent:
            for own in (None, "shared"):
                answer = post(app, path, body if own is None else {**body, "cache_salt": own},
                              key)
                assert answer.status_code == 200, answer.text
    salts = [params.cache_salt for _, params, _ in thread.submitted]
    a, b = key_salt("key-a"), key_salt("key-b")
    assert a != b
    assert salts == [f"key:{a}|", f"key:{a}|shared"] * 3 + [f"key:{b}|", f"key:{b}|shared"] * 3
    assert [key for _, _, key in thread.submitted] == ["key-a"] * 6 + ["key-b"] * 6


def test_choices_of_several_prompts_are_in_openai_order_with_their_echo_and_usage():
    thread = AnsweringEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model())
    body = {"prompt": [[72, 105], [79, 107, 33]], "n": 2, "max_tokens": 2, "echo": True}
    answer = post(app, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt, sample = divmod(c["index"], 2)
        tokens = [answer_token(prompt + 1, sample, i) for i in range(2)]
        assert c["token_ids"] == tokens and c["finish_reason"] == "length"
        assert c["text"] == ["Hi", "Ok!"][prompt] + "".join(map(chr, tokens))
    assert answer.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 8,
                                      "total_tokens": 13}


def _guarded_call(content_length: int, max_body_bytes: int):
    """(what ``Guard`` sent, whether the app was reached) for a POST announcing
    ``content_length`` bytes, whose body never comes."""
    reached = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        raise AssertionError("the body was read")

    sent = []

    async def send(message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "client": None,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(content_length).encode())]}
    guard = Guard(app, ServeLimits(max_body_bytes=max_body_bytes), AuthConfig())
    asyncio.run(guard(scope, receive, send))
    return sent, reached


def test_a_content_length_past_the_body_limit_is_413_before_the_body_is_read():
    sent, reached = _guarded_call(1001, 1000)
    assert sent[0]["status"] == 413 and reached == []
    assert b"limit of 1000 bytes" in sent[1]["body"]
    sent, reached = _guarded_call(1000, 1000)            # at the limit: the app's to read
    assert sent[0]["status"] == 204 and reached == ["/v1/completions"]


def test_chat_takes_max_completion_tokens_over_max_tokens():
    thread = AnsweringEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "max_completion_tokens": 2}
    answer = post(app, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    assert [params.max_new_tokens for _, params, _ in thread.submitted] == [2]
    assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_streamed_response_counts_its_chunk_envelopes_against_the_limit():
    thread = AnsweringEngineThread()
    served = served_model()
    bound = ResponseBounds.of(served.tokenizer, served.vocab_size).completion
    thread.max_response_bytes = ResponseSize(1, 1, 4, None, bound=bound).estimate_bytes
    app = create_app(thread, ServeMetrics("m"), served)
    body = {"prompt": [1, 2], "max_tokens": 4}
    assert post(app, "/v1/completions", body).status_code == 200           # JSON: at the limit
    refused = post(app, "/v1/completions", {**body, "stream": True})
    assert refused.status_code == 400                                      # streamed: past it
    assert "(--max-response-bytes)" in refused.json()["error"]["message"]
    assert len(thread.submitted) == 1                                      # nothing queued


def test_a_prompt_filling_the_context_is_named_and_one_token_less_names_max_tokens():
    thread = AnsweringEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model())

    def refusal(prompt_tokens: int, max_tokens: int) -> dict:
        answer = post(app, "/v1/completions", {"prompt": [7] * prompt_tokens,
                                               "max_tokens": max_tokens})
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]
    alone = refusal(64, 1)
    assert alone["param"] == "prompt" and "the prompt alone holds 64 tokens" in alone["message"]
    both = refusal(63, 2)
    assert both["param"] == "max_tokens" and "asks for 65 (63 in the prompt, 2 max_tokens)" \
        in both["message"]
    assert post(app, "/v1/completions", {"prompt": [7] * 63, "max_tokens": 1}).status_code == 200
    assert len(thread.submitted) == 1


def test_min_tokens_with_stop_ids_covering_the_vocabulary_with_eos_is_refused_unqueued():
    thread = AnsweringEngineThread()
    app = create_app(thread, ServeMetrics("m"), served_model(eos_ids=(0,)))
    body = {"prompt": [1, 2], "max_tokens": 2, "min_tokens": 1,
            "stop_token_ids": list(range(1, 256))}         # EOS (0) makes it all 256
    refused = post(app, "/v1/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
    assert thread.submitted == []
    assert post(app, "/v1/completions", {**body, "ignore_eos": True}).status_code == 200


def test_without_a_tokenizer_the_echo_is_spaced_ids_and_stop_strings_are_refused():
    thread = AnsweringEngineThread()
    app = create_app(thread, ServeMetrics("m"), ServedModel("m", None, 256, 64, 8))
    answer = post(app, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "echo": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "1 2 3 65 66"
    refused = post(app, "/v1/completions", {"prompt": [1, 2, 3], "stop": ["6"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
    assert len(thread.submitted) == 1


def test_an_api_key_opens_a_route_only_as_a_bearer_token():
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    guard = Guard(app, ServeLimits(), AuthConfig(("key-a",)))

    async def status(authorization: str) -> int:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.get("/v1/models", headers={"Authorization": authorization})
            return answer.status_code
    assert asyncio.run(status("Bearer key-a")) == asyncio.run(status("bearer key-a")) == 204
    for refused in ("Basic key-a", "Token key-a", " key-a", "Bearer key-b"):
        assert asyncio.run(status(refused)) == 401, refused


class AsleepEngine:
    """What /resize's work reads of an engine asleep (the Engine's own refusal, a 500)."""
    is_sleeping = True

    def resize_cache(self, cache_bytes, memory_utilization=None, preempt=False):
        raise EngineSleepingError("the engine is asleep")


class CallingEngineThread(SilentEngineThread):
    """Runs ``call(work)`` at once on an AsleepEngine."""

    def call(self, work) -> Future:
        future: Future = Future()
        try:
            future.set_result(work(AsleepEngine()))
        except Exception as error:     # noqa: BLE001 -- handed to the route, as the thread does
            future.set_exception(error)
        return future


def test_a_resize_while_asleep_is_409_saying_to_wake_up_first():
    app = create_app(CallingEngineThread(), ServeMetrics("m"), served_model())
    answer = post(app, "/resize", {"cache_bytes": 4096})
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["param"] == "cache_bytes" and "POST /wake_up first" in error["message"]
