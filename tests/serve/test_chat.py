"""/v1/chat/completions and the completions API's new fields on the tiny model with a byte-level
tokenizer and a small chat template: answers equal Engine.chat / Engine.generate, streamed and
not; a list of prompts, echo and logprobs; what a model without a template gets (400)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, model, prompts, serving, wait_until_idle

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
            done = httpx.post(url, json=body).json()
            assert done["object"] == "chat.completion" and done["usage"]["completion_tokens"] == 16
            for choice, sample in zip(done["choices"], out.outputs):
                assert choice["message"] == {"role": "assistant", "content": sample.text}
                assert choice["token_ids"] == sample.token_ids
                content = choice["logprobs"]["content"]
                assert [c["logprob"] for c in content] == pytest.approx(
                    [e.logprob for e in sample.logprobs], abs=1e-5)
                assert all(len(c["top_logprobs"]) == 2 for c in content)
            with httpx.stream("POST", url, json={**body, "stream": True,
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
        done = httpx.post(server.url + "/v1/completions", json=body).json()
        assert [c["index"] for c in done["choices"]] == list(range(6))
        for i, choice in enumerate(done["choices"]):
            out, sample = want[i // 2], want[i // 2].outputs[i % 2]
            assert choice["token_ids"] == sample.token_ids
            ids = list(out.prompt_token_ids) + sample.token_ids
            assert choice["text"] == " ".join(map(str, out.prompt_token_ids)) + " ".join(
                map(str, sample.token_ids))   # no tokenizer: the ids in decimal
            lp = choice["logprobs"]
            assert lp["tokens"] == [str(t) for t in ids]
            assert lp["token_logprobs"][0] is None
            wanted = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in sample.logprobs]
            assert lp["token_logprobs"][1:] == pytest.approx(wanted, abs=1e-5)
        async def streamed():
            async with httpx.AsyncClient() as client:
                async with client.stream("POST", server.url + "/v1/completions",
                                         json={**body, "stream": True}) as r:
                    return [json.loads(line[5:]) async for line in r.aiter_lines()
                            if line.startswith("data:") and line != "data: [DONE]"]
        ids_by_choice = {}
        for chunk in asyncio.run(streamed()):
            for c in chunk["choices"]:
                ids_by_choice.setdefault(c["index"], []).extend(c["token_ids"])
        assert [ids_by_choice[i] for i in range(6)] == [s.token_ids for o in want for s in o.outputs]
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("tokenizer,body,param,words", [
    (None, {"messages": CHATS[0]}, "messages", "no tokenizer"),
    ("plain", {"messages": CHATS[0]}, "messages", "no chat template"),
    ("plain", {"messages": CHATS[0], "chat_template": "{% if %}"}, "chat_template", "does not render"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text"),
    ("chat", {"messages": []}, "messages", "at least 1"),
    ("chat", {"messages": CHATS[0], "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("chat", {"messages": CHATS[0], "logprobs": True, "top_logprobs": 50}, "top_logprobs", "[0, 20]"),
    ("chat", {"messages": CHATS[0], "max_completion_tokens": 60}, "max_completion_tokens", "context"),
    ("chat", {"messages": CHATS[0], "tools": []}, "tools", "unknown field"),
])
def test_chat_mistakes_are_400_naming_the_field(tokenizer, body, param, words):
    tok = {None: None, "plain": byte_tokenizer(), "chat": byte_tokenizer(chat_template=True)}[tokenizer]
    with serving(VMEM, tokenizer=tok) as (server, engine):
        response = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)


def test_a_chat_template_in_the_request_replaces_the_models():
    with serving(VMEM, tokenizer=byte_tokenizer()) as (server, _):
        body = {"messages": CHATS[0], "chat_template": "{{ messages[0]['content'] }}!",
                "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        done = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    with Engine(model(), byte_tokenizer(), **VMEM) as engine:
        want = engine.generate([list(b"hello!")], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert done["choices"][0]["token_ids"] == want[0].outputs[0].token_ids
