"""Every error the server answers is OpenAI's JSON shape with the right status: 400 naming the
field for each bad request, 404 naming ``model`` for a model not served, 404/405 for a wrong
path or method, 503 with Retry-After when the
queue is full, 500 with no traceback when a step fails; the server stays up and nothing is held
afterwards."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from . import local_http
from .conftest import NAME, VMEM, assert_memory_at_baseline, serving, wait_until_idle

OK = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}

# (case id, request body as sent, param the error names, words the message holds)
BAD_REQUESTS = [
    ("malformed-json", '{"prompt": [1, 2', None, "not valid JSON"),
    ("not-an-object", "[1, 2, 3]", None, "must be a JSON object"),
    ("unknown-field", {**OK, "frobnicate": 3}, "frobnicate", "unknown field 'frobnicate'"),
    ("missing-prompt", {"max_tokens": 4}, "prompt", "prompt"),
    ("empty-prompt", {**OK, "prompt": []}, "prompt", "at least 1"),
    ("prompt-of-floats", {**OK, "prompt": [1.5, 2]}, "prompt", "prompt"),
    ("text-prompt-without-tokenizer", {**OK, "prompt": "hello"}, "prompt", "no tokenizer"),
    ("token-outside-vocab", {**OK, "prompt": [1, 999]}, "prompt", "outside the vocabulary [0, 256)"),
    ("prompt-longer-than-context", {**OK, "prompt": [1] * 70}, "prompt", "context is 64 tokens"),
    ("max-tokens-past-context", {**OK, "max_tokens": 62}, "max_tokens", "context is 64 tokens"),
    ("max-tokens-zero", {**OK, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-string", {**OK, "max_tokens": "4"}, "max_tokens", "valid integer"),
    ("temperature-negative", {**OK, "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ("temperature-nan", '{"prompt": [1], "temperature": NaN}', "temperature", "finite number"),
    ("temperature-string", {**OK, "temperature": "hot"}, "temperature", "valid number"),
    ("top-p-zero", {**OK, "top_p": 0}, "top_p", "greater than 0"),
    ("top-p-above-one", {**OK, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("top-k-below-minus-one", {**OK, "top_k": -2}, "top_k", "greater than or equal to -1"),
    ("n-zero", {**OK, "n": 0}, "n", "greater than or equal to 1"),
    ("n-above-max-batch", {**OK, "n": 9}, "n", "at most 8"),
    ("seed-float", {**OK, "seed": 1.5}, "seed", "valid integer"),
    ("stream-not-bool", {**OK, "stream": "yes"}, "stream", "valid boolean"),
    ("stop-without-tokenizer", {**OK, "stop": "x"}, "stop", "need a tokenizer"),
    ("too-many-stops", {**OK, "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    # issue 27 item 8: what a client sends in bulk is capped, naming the field
    ("huge-stop-token-ids", {**OK, "stop_token_ids": list(range(2000))}, "stop_token_ids",
     "at most 1024"),
    ("huge-logit-bias", {**OK, "logit_bias": {str(i): 1.0 for i in range(1100)}}, "logit_bias",
     "at most 1024"),
    ("huge-prompt-list", {**OK, "prompt": [[1, 2]] * 257}, "prompt", "at most 256 prompts"),
    ("prompt-list-with-an-empty-one", {**OK, "prompt": [[1, 2], []]}, "prompt", "at least 1"),
    # the sampling fields OpenAI clients send, each checked by SamplingParams' own rules
    ("temperature-past-float32", {**OK, "temperature": 1e39}, "temperature", "float32"),
    ("frequency-penalty-out-of-range", {**OK, "frequency_penalty": 2.5}, "frequency_penalty",
     "[-2, 2]"),
    ("repetition-penalty-zero", {**OK, "repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ("min-p-above-one", {**OK, "min_p": 1.5}, "min_p", "[0, 1]"),
    ("min-tokens-past-max-tokens", {**OK, "min_tokens": 5}, "min_tokens", "[0, max_tokens]"),
    ("logprobs-too-many", {**OK, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("logit-bias-key-not-a-token", {**OK, "logit_bias": {"a": 1.0}}, "logit_bias", "token ids"),
    # int() takes these, and "²" once made the message's own search raise (a 500)
    ("logit-bias-key-superscript", {**OK, "logit_bias": {"²": 1.0}}, "logit_bias", "'²'"),
    ("logit-bias-key-underscore", {**OK, "logit_bias": {"1_0": 1.0}}, "logit_bias", "'1_0'"),
    ("logit-bias-key-arabic-digit", {**OK, "logit_bias": {"٣": 1.0}}, "logit_bias", "ASCII"),
    ("logit-bias-key-leading-zero", {**OK, "logit_bias": {"5": 1.0, "05": -1.0}}, "logit_bias",
     "'05'"),
    ("logit-bias-key-spaces", {**OK, "logit_bias": {" 7 ": 1.0}}, "logit_bias", "' 7 '"),
    ("stream-options-without-stream", {**OK, "stream_options": {"include_usage": True}},
     "stream_options", "stream: true"),
    ("logit-bias-too-large", {**OK, "logit_bias": {"5": 101.0}}, "logit_bias", "[-100, 100]"),
    ("logit-bias-outside-vocab", {**OK, "logit_bias": {"999": 1.0}}, "logit_bias", "outside"),
    ("best-of-above-n", {**OK, "best_of": 2}, "best_of", "not supported"),
    ("echo-not-bool", {**OK, "echo": "yes"}, "echo", "valid boolean"),
    ("stop-token-ids-strings", {**OK, "stop_token_ids": ["1"]}, "stop_token_ids", "valid integer"),
    # int() refuses 4,300 digits: a 500 (ValueError) before keys were capped at 19 digits
    ("logit-bias-key-4301-digits", {**OK, "logit_bias": {"1" * 4301: 1.0}}, "logit_bias",
     "token ids"),
    # a stop string that is not Unicode text can never match: it was accepted and ignored
    ("stop-lone-surrogate", '{"prompt": [1], "stop": ["ok", "\\ud800"]}', "stop",
     "lone surrogate"),
    # pydantic's error had no field: "None: Input should be a valid string..."
    ("field-name-lone-surrogate", '{"prompt": [1], "\\ud800": 1}', None, "not Unicode text"),
]


@pytest.fixture(scope="module")
def served():
    with serving(VMEM) as pair:
        yield pair


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]


@pytest.mark.parametrize("case,body,param,words", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field(served, case, body, param, words):
    server, engine = served
    content = body if isinstance(body, str) else json.dumps(body)
    response = local_http.post(server.url + "/v1/completions", content=content,
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    assert server.engine_thread.pending_requests == 0
    assert_memory_at_baseline(engine)
    assert local_http.post(server.url + "/v1/completions", json=OK).status_code == 200


# a list field of a million entries: validating them one by one took 15 s on the event loop
# (every other client stalled) and 1.4 GiB; the counts are checked before any entry is read
HUGE_LISTS = [("/v1/completions", {"prompt": [1], "stop": [[]] * 10**6}, "stop",
               "stop: at most 16 entries, got 1000000"),
              ("/v1/completions", {"prompt": [None] * 300_000}, "prompt",
               "at most 256 prompts in one request, got 300000"),
              ("/v1/chat/completions", {"messages": [1] * 10**6}, "messages",
               "messages: at most 16384 entries, got 1000000")]


@pytest.mark.parametrize("path,body,param,words", HUGE_LISTS, ids=[c[2] for c in HUGE_LISTS])
def test_huge_list_fields_are_400_without_stalling_other_clients(served, monkeypatch, path, body,
                                                                 param, words):
    from vmemkv.runtime.serve import app, protocol
    server, engine = served
    module, name = (protocol, "parse_completion_request") if "chat" not in path else \
        (app, "parse_chat_request")
    parse, parsing, release = getattr(module, name), threading.Event(), threading.Event()

    def held(body_bytes):            # the parse waits until another client has been answered
        parsing.set()
        release.wait(60)
        return parse(body_bytes)
    monkeypatch.setattr(module, name, held)
    got = {}
    worker = threading.Thread(target=lambda: got.update(r=local_http.post(
        server.url + path, json=body, timeout=120)))
    worker.start()
    assert parsing.wait(60)
    try:   # parsed on the event loop, /health waited for the parse: a timeout, not a 200
        assert local_http.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        release.set()
        worker.join(120)
    assert got["r"].status_code == 400
    error = error_of(got["r"])
    assert error["param"] == param and words in error["message"], error["message"]
    assert_memory_at_baseline(engine)


@pytest.mark.parametrize("path, body", [("/v1/completions", OK),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_model_not_served_is_a_404_naming_model_as_vllm_and_openai_answer(served, path, body):
    # it was a 400 (the OpenAI client's BadRequestError); vLLM and OpenAI answer 404
    # (NotFoundError), whose clients tell a wrong model name from a bad request by it
    server, engine = served
    response = local_http.post(server.url + path, json={**body, "model": "gpt-4"})
    assert response.status_code == 404
    error = error_of(response)
    assert error["type"] == "not_found_error" and error["param"] == "model"
    assert error["message"] == f"model 'gpt-4' is not served here; this server serves " \
                               f"[{NAME!r}]"
    assert server.engine_thread.pending_requests == 0
    assert_memory_at_baseline(engine)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/chat", 404), ("GET", "/v1/completions", 405)])
def test_wrong_path_or_method_is_openai_shaped(served, method, path, status):
    response = local_http.request(method, served[0].url + path)
    assert response.status_code == status and error_of(response)["param"] is None


def test_an_empty_stop_list_needs_no_tokenizer(served):
    response = local_http.post(served[0].url + "/v1/completions", json={**OK, "stop": []})
    assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 4


def test_a_text_prompt_with_a_lone_surrogate_is_400_naming_the_prompt():
    from ..engine.byte_tokenizer import byte_tokenizer
    with serving(VMEM, tokenizer=byte_tokenizer()) as (server, engine):
        for prompt in ("a\ud800", ["ok", "b\udfff"]):
            response = local_http.post(server.url + "/v1/completions",
                                       content=json.dumps({**OK, "prompt": prompt}),   # escaped
                                       headers={"Content-Type": "application/json"})
            assert response.status_code == 400
            error = error_of(response)
            assert error["param"] == "prompt" and "lone surrogate" in error["message"]
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)


def test_more_prompts_than_the_queue_holds_is_400_and_queues_nothing():
    """A 503 says "retry": for a batch that can never fit, a retrying client looped forever,
    each try queueing and aborting the prompts that fitted."""
    with serving(VMEM, max_queue=2) as (server, engine):
        response = local_http.post(server.url + "/v1/completions", json={**OK, "prompt": [[1], [2], [3]]})
        assert response.status_code == 400
        error = error_of(response)
        assert error["param"] == "prompt" and "--max-queue" in error["message"]
        assert 'vmemkv:num_aborted_requests_total{model_name="tiny-llama"} 0.0' in \
            local_http.get(server.url + "/metrics").text
        assert server.engine_thread.pending_requests == 0
        ok = local_http.post(server.url + "/v1/completions", json={**OK, "prompt": [[1], [2]]})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_full_queue_is_503_with_retry_after(monkeypatch):
    gate = threading.Event()
    with serving(VMEM, max_queue=1) as (server, engine):
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda: gate.wait(30) and step())   # hold step 1
        first = {}
        worker = threading.Thread(target=lambda: first.update(
            r=local_http.post(server.url + "/v1/completions", json=OK, timeout=60)))
        worker.start()
        while server.engine_thread.pending_requests < 1:   # the first is in flight
            worker.join(0.01)
        second = local_http.post(server.url + "/v1/completions", json=OK)
        assert second.status_code == 503 and second.headers["Retry-After"] == "1"
        assert error_of(second)["type"] == "server_overloaded"
        assert "limit of 1 requests" in error_of(second)["message"]
        gate.set()
        worker.join(60)
        assert first["r"].status_code == 200
        assert len(first["r"].json()["choices"][0]["token_ids"]) == 4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failing_step_is_500_without_traceback_and_the_server_stays_up(monkeypatch, stream):
    with serving(VMEM) as (server, engine):
        step = engine.step

        def broken():
            raise RuntimeError("secret internals at 0xdeadbeef")
        monkeypatch.setattr(engine, "step", broken)
        response = local_http.post(server.url + "/v1/completions", json={**OK, "stream": stream})
        if stream:   # the status line was sent: the error is the last event before [DONE]
            events = [line for line in response.text.splitlines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][5:])["error"]
        else:
            assert response.status_code == 500
            error = error_of(response)
        assert error["type"] == "internal_server_error" and "secret" not in response.text
        assert "Traceback" not in response.text and "server log" in error["message"]
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
        monkeypatch.setattr(engine, "step", step)
        assert local_http.get(server.url + "/health").status_code == 200
        assert local_http.post(server.url + "/v1/completions", json=OK).status_code == 200


def test_serving_without_the_extra_names_it(monkeypatch):
    from vmemkv.runtime.serve import ServeConfigError
    from vmemkv.runtime.serve.server import require_serve_extra
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)   # import uvicorn fails
    with pytest.raises(ServeConfigError, match=r"pip install 'vmemkv\[serve\]'"):
        require_serve_extra()


@pytest.mark.parametrize("max_queue", [0, True, 1.5])
def test_a_bad_max_queue_is_refused_naming_it(max_queue):
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.serve import Server, ServeConfigError

    from .conftest import model
    with Engine(model(), **VMEM) as engine:
        with pytest.raises(ServeConfigError, match=f"max_queue must be an int >= 1, got {max_queue!r}"):
            Server(engine, "tiny-llama", port=0, max_queue=max_queue)
        assert engine.has_unfinished() is False


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_request_whose_sampling_fails_is_its_own_500_and_a_live_stream_goes_on(monkeypatch, stream):
    """Issue 27 item 1: the engine fails the request alone; its client gets a 500 naming it as
    that request's internal error, a concurrent stream ends with exactly its solo tokens."""
    from vmemkv.runtime.engine.sampler import Sampler
    victim = {**OK, "temperature": 1.0, "seed": 666, "stream": stream}
    other = {"prompt": [4, 5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True}
    one = Sampler._one

    def faulty(row, sample):
        if sample.params.seed == 666:
            raise RuntimeError("secret internals at 0xdeadbeef")
        return one(row, sample)

    gate = threading.Event()
    with serving(VMEM) as (server, engine):
        solo = local_http.post(server.url + "/v1/completions", json={**other, "stream": False})
        want = solo.json()["choices"][0]["token_ids"]
        monkeypatch.setattr(Sampler, "_one", staticmethod(faulty))
        unfinished = engine.has_unfinished     # the engine thread idles until both are queued
        monkeypatch.setattr(engine, "has_unfinished", lambda: gate.is_set() and unfinished())
        got = {}
        threads = [threading.Thread(target=lambda key=key, body=body: got.update(
            {key: local_http.post(server.url + "/v1/completions", json=body, timeout=60)}))
            for key, body in (("victim", victim), ("other", other))]
        for thread in threads:
            thread.start()
        while len(engine.scheduler.waiting) < 2:
            threads[0].join(0.01)
        gate.set()
        server.engine_thread.abort(-1)         # a no-op command: wakes the idle thread now
        for thread in threads:
            thread.join(60)
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
    if stream:
        events = [line for line in got["victim"].text.splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][5:])["error"]
    else:
        assert got["victim"].status_code == 500
        error = error_of(got["victim"])
    assert error["type"] == "internal_server_error" and "this request only" in error["message"]
    assert "secret" not in got["victim"].text
    chunks = [json.loads(line[5:]) for line in got["other"].text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    assert got["other"].text.rstrip().endswith("data: [DONE]")
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == want
