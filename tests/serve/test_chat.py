"""/v1/chat/completions and the completions API's new fields on the tiny model with a byte-level
tokenizer and a small chat template: answers equal Engine.chat / Engine.generate, streamed and
not; a list of prompts, echo and logprobs; what a model without a template gets (400)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.serve.limits import ServeLimits

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, model, prompts, serving, wait_until_idle

TRUSTED = ServeLimits(trust_request_chat_template=True)
CHATS = [[{"role": "user", "content": "hello"}],
         [{"role": "system", "content": "be kind"}, {"role": "user", "content": "日本"}]]
BODY = dict(max_completion_tokens=8, temperature=0.7, seed=3, n=2, ignore_eos=True)


def engine_chat(params: SamplingParams) -> list:
    with Engine(model(), byte_tokenizer(chat_template=True), **VMEM) as engine:
        return engine.chat(CHATS, params)


def _chunks(response) -> list:
    return [json.loads(line[5:]) for line in response.iter_lines()
            if line.startswith("data:") and line != "data: [DONE]"]


def test_chat_completions_equal_engine_chat_streamed_and_not():
    want = engine_chat(SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, n=2,
                                      ignore_eos=True, logprobs=2))
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, engine):
        url = server.url + "/v1/chat/completions"
        for messages, out in zip(CHATS, want):
            body = {**BODY, "messages": messages, "logprobs": True, "top_logprobs": 2}
            done = local_http.post(url, json=body).json()
            assert done["object"] == "chat.completion" and done["usage"]["completion_tokens"] == 16
            for choice, sample in zip(done["choices"], out.outputs):
                assert choice["message"] == {"role": "assistant", "content": sample.text}
                assert choice["token_ids"] == sample.token_ids
                content = choice["logprobs"]["content"]
                assert [c["logprob"] for c in content] == pytest.approx(
                    [e.logprob for e in sample.logprobs], abs=1e-5)
                assert all(len(c["top_logprobs"]) == 2 for c in content)
                # each token's own bytes (ids are bytes here): a split character is rebuilt
                assert [c["bytes"] for c in content] == [[t] for t in sample.token_ids]
                assert all(t["bytes"] == list(t["token"].encode()) or len(t["bytes"]) == 1
                           for c in content for t in c["top_logprobs"])
            with local_http.stream("POST", url, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as r:
                chunks = _chunks(r)
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert [c["delta"] for c in chunks[0]["choices"]] == [{"role": "assistant", "content": ""}] * 2
            texts = {0: "", 1: ""}
            for chunk in chunks[1:-1]:
                for c in chunk["choices"]:
                    texts[c["index"]] += c["delta"].get("content", "")
            assert [texts[0], texts[1]] == [s.text for s in out.outputs]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_a_list_of_prompts_with_echo_and_logprobs_equals_engine_generate():
    batch = prompts(3, 3, 9, seed=21)
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=8, n=2, ignore_eos=True,
                            logprobs=1, prompt_logprobs=1)
    with Engine(model(), **VMEM) as engine:
        want = engine.generate(batch, params)
    with serving(VMEM) as (server, engine):
        body = dict(prompt=batch, max_tokens=5, temperature=0.9, seed=8, n=2, ignore_eos=True,
                    logprobs=1, echo=True, frequency_penalty=0.0, presence_penalty=0.0, best_of=2)
        done = local_http.post(server.url + "/v1/completions", json=body).json()
        assert [c["index"] for c in done["choices"]] == list(range(6))
        for i, choice in enumerate(done["choices"]):
            out, sample = want[i // 2], want[i // 2].outputs[i % 2]
            assert choice["token_ids"] == sample.token_ids
            ids = list(out.prompt_token_ids) + sample.token_ids
            assert choice["text"] == " ".join(map(str, ids))   # no tokenizer: ids in decimal
            lp = choice["logprobs"]
            assert lp["tokens"] == [str(t) for t in ids]
            assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] \
                == lp["tokens"]
            assert lp["token_logprobs"][0] is None
            wanted = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in sample.logprobs]
            assert lp["token_logprobs"][1:] == pytest.approx(wanted, abs=1e-5)
        async def streamed():
            async with httpx.AsyncClient() as client:
                async with client.stream("POST", server.url + "/v1/completions",
                                         json={**body, "stream": True}) as r:
                    return [json.loads(line[5:]) async for line in r.aiter_lines()
                            if line.startswith("data:") and line != "data: [DONE]"]
        ids_by_choice, text_by_choice, offsets = {}, {}, {}
        for chunk in asyncio.run(streamed()):
            for c in chunk["choices"]:
                ids_by_choice.setdefault(c["index"], []).extend(c["token_ids"])
                text_by_choice[c["index"]] = text_by_choice.get(c["index"], "") + c["text"]
                lp = c["logprobs"]
                offsets.setdefault(c["index"], []).extend(zip(lp["text_offset"], lp["tokens"]))
        assert [ids_by_choice[i] for i in range(6)] == [s.token_ids for o in want for s in o.outputs]
        for i, choice in enumerate(done["choices"]):          # the same text, the same offsets
            assert text_by_choice[i] == choice["text"]
            assert offsets[i] == list(zip(choice["logprobs"]["text_offset"],
                                          choice["logprobs"]["tokens"]))
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("tokenizer,body,param,words", [
    (None, {"messages": CHATS[0]}, "messages", "no tokenizer"),
    ("plain", {"messages": CHATS[0]}, "messages", "no chat template"),
    ("plain", {"messages": CHATS[0], "chat_template": "{% if %}"}, "chat_template", "does not render"),
    ("chat", {"messages": CHATS[0], "chat_template": " "}, "chat_template", "empty"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "x", "\ud800": 1}]},   # was a 500
     "messages[0].'\\ud800'", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name",
     "a string"),
    ("chat", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content",
     "lone surrogate"),
    ("chat", {"messages": CHATS[0], "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "only text"),
    ("chat", {"messages": []}, "messages", "at least 1"),
    ("chat", {"messages": CHATS[0], "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("chat", {"messages": CHATS[0], "logprobs": True, "top_logprobs": 50}, "top_logprobs", "[0, 20]"),
    ("chat", {"messages": CHATS[0], "max_completion_tokens": 60}, "max_completion_tokens", "context"),
    ("chat", {"messages": CHATS[0], "tools": [{"type": "function"}]}, "tools",
     "tool calls are not supported"),
])
def test_chat_mistakes_are_400_naming_the_field(tokenizer, body, param, words):
    tok = {None: None, "plain": byte_tokenizer(), "chat": byte_tokenizer(chat_template=True)}[tokenizer]
    with serving(VMEM, tokenizer=tok, limits=TRUSTED) as (server, engine):
        response = local_http.post(server.url + "/v1/chat/completions", content=json.dumps(body),
                                   headers={"Content-Type": "application/json"})   # \ud800 escaped
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
        # a request holds one conversation: the engine's batch prefix ("conversation 0: ")
        # named a conversation the client never numbered
        assert not error["message"].startswith("conversation"), error
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)


def test_a_chat_template_in_the_request_is_refused_unless_the_server_trusts_them():
    """A template is code the server runs (a client's nested loops stalled every other client
    for 36 s): refused by name unless started with --trust-request-chat-template."""
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, engine):
        body = {"messages": CHATS[0], "chat_template": "{% for i in range(9) %}x{% endfor %}"}
        response = local_http.post(server.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
        assert server.engine_thread.pending_requests == 0


def test_prompts_are_rendered_off_the_event_loop(monkeypatch):
    """While one request's template renders (held here until /health has answered), the
    server answers others: rendering and tokenizing run on a worker thread."""
    import threading

    from vmemkv.runtime.serve import chat as serve_chat
    rendering, health_answered = threading.Event(), threading.Event()
    real = serve_chat.chat_prompt_ids

    def slow(*args, **kwargs):
        rendering.set()
        assert health_answered.wait(60), "the event loop was blocked while rendering"
        return real(*args, **kwargs)

    monkeypatch.setattr(serve_chat, "chat_prompt_ids", slow)
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, _):
        body = {"messages": CHATS[0], "max_tokens": 2}
        worker = threading.Thread(target=lambda: results.append(
            local_http.post(server.url + "/v1/chat/completions", json=body, timeout=120)))
        results: list = []
        worker.start()
        assert rendering.wait(60)
        assert local_http.get(server.url + "/health", timeout=120).status_code == 200
        health_answered.set()
        worker.join(120)
        assert results and results[0].status_code == 200


def test_a_chat_template_in_the_request_replaces_the_models():
    with serving(VMEM, tokenizer=byte_tokenizer(), limits=TRUSTED) as (server, _):
        body = {"messages": CHATS[0], "chat_template": "{{ messages[0]['content'] }}!",
                "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        done = local_http.post(server.url + "/v1/chat/completions", json=body).json()
    with Engine(model(), byte_tokenizer(), **VMEM) as engine:
        want = engine.generate([list(b"hello!")], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert done["choices"][0]["token_ids"] == want[0].outputs[0].token_ids


def test_logprobs_bytes_rebuild_characters_split_over_tokens():
    """OpenAI's ``bytes``: joined over the tokens, the text's UTF-8, though each token of an
    emoji split over four decodes alone as U+FFFD (byte-level BPE pieces, GPT-2's alphabet)."""
    from vmemkv.runtime.engine.logprobs import TokenLogprobs
    from vmemkv.runtime.serve.logprobs_format import TokenStrings, chat_logprobs
    text = "👩日 x"
    ids = list(text.encode())
    content = chat_logprobs(TokenStrings(byte_tokenizer()),
                            [TokenLogprobs(t, -1.0, 1, ((t, -1.0),)) for t in ids])["content"]
    assert content[0]["token"] == "\ufffd"
    assert bytes(b for c in content for b in c["bytes"]).decode() == text
    assert [t["bytes"] for c in content for t in c["top_logprobs"]] == [[t] for t in ids]
