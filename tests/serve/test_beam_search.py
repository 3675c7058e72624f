"""use_beam_search / beam_width (vLLM's names) on /v1/completions and /v1/chat/completions: the
choices are Engine.beam_search's beams, streamed or not; fields beam search cannot honour are a
400 naming them, before anything is queued."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import (PAGED, VMEM, assert_memory_at_baseline, model, prompts, serving,
                       wait_until_idle)

BODY = dict(use_beam_search=True, beam_width=3, n=2, max_tokens=6, ignore_eos=True)


def test_completions_choices_are_the_engines_beams_and_the_field_errors_name_it():
    batch = prompts(2, 4, 12, seed=3)
    with Engine(model(), **PAGED) as engine:
        want = [[c.token_ids for c in out.outputs] for out in engine.beam_search(
            batch, BeamSearchParams(3, max_new_tokens=6, num_return_beams=2, ignore_eos=True))]
    with serving(PAGED) as (server, engine):
        url = server.url + "/v1/completions"
        r = local_http.post(url, json={**BODY, "prompt": batch}, timeout=60)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [t for beams in want for t in beams]
        with local_http.stream("POST", url, json={**BODY, "prompt": batch[0], "stream": True},
                               timeout=60) as streamed:
            assert streamed.status_code == 200
            assert sum(line.startswith("data: {") for line in streamed.iter_lines()) == 12
        for extra, param in [(dict(temperature=0.7), "temperature"), (dict(top_p=0.5), "top_p"),
                             (dict(logprobs=1), "logprobs"), (dict(n=4), "n"),
                             (dict(beam_width=9), "beam_width"),
                             (dict(use_beam_search=False), "beam_width")]:
            bad = local_http.post(url, json={**BODY, **extra, "prompt": batch[0]}, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_chat_choices_are_the_engines_beams_with_their_text():
    chat = [{"role": "user", "content": "hello"}]
    params = BeamSearchParams(3, max_new_tokens=6, num_return_beams=2, ignore_eos=True)
    with Engine(model(), byte_tokenizer(chat_template=True), **VMEM) as engine:
        (want,) = engine.beam_search(engine_prompts(engine, chat), params)
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, engine):
        body = {**BODY, "messages": chat, "max_completion_tokens": 6}
        del body["max_tokens"]
        r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in got] == [c.token_ids for c in want.outputs]
        assert [c["message"]["content"] for c in got] == [c.text for c in want.outputs]
        # the field the client sent: logprobs alone (top_logprobs was named, never sent), or
        # top_logprobs with it
        for extra, param in (({"logprobs": True}, "logprobs"),
                             ({"logprobs": True, "top_logprobs": 2}, "top_logprobs")):
            bad = local_http.post(server.url + "/v1/chat/completions", timeout=60,
                                  json={**body, **extra})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, extra


def engine_prompts(engine, messages) -> list:
    from vmemkv.runtime.engine.chat import chat_prompts
    return chat_prompts(engine.tokenizer, messages, None)


def test_beams_the_cache_can_never_hold_are_a_400_and_the_other_requests_finish():
    """Four beam searches in one HTTP request, then a plain request, queued together on a paged
    cache too small for one group at its full length (4 beams of 28 + 10 tokens; the other
    three fit, swapped out and back or recomputed): the engine fails that one alone, the beam
    request is a 400 naming beam_width (no internals), the plain request finishes, memory goes
    back to baseline. Before, the step raised and the server failed every live request
    (500s)."""
    import threading
    import time
    options = dict(cache="paged", block_size=4, max_batch=16, max_context=128,
                   cache_bytes=28 * 1024, preemption="swap", swap_bytes=256 * 1024)
    beams = dict(use_beam_search=True, beam_width=4, max_tokens=10, ignore_eos=True)
    plain = dict(prompt=[1, 2, 3, 4, 5], max_tokens=40, ignore_eos=True, temperature=0)
    with serving(options) as (server, engine):
        url, thread, gate = server.url + "/v1/completions", server.engine_thread, threading.Event()
        thread.call(lambda _: gate.wait(60))       # the engine thread holds until both queue

        def queued(count: int) -> None:   # the bound turns a hang into a failure, no timing
            deadline = time.monotonic() + 60
            while thread.queued_commands < count:
                assert time.monotonic() < deadline, "requests never queued"
                time.sleep(0.01)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            second = pool.submit(httpx.post, url, json={**beams, "prompt": prompts(4, 20, 30, 5)},
                                 timeout=120)
            queued(4)
            first = pool.submit(httpx.post, url, json=plain, timeout=120)
            queued(5)
            gate.set()
            alone, group = first.result(), second.result()
        assert alone.status_code == 200, alone.text
        (choice,) = alone.json()["choices"]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 40
        assert group.status_code == 400, group.text
        error = group.json()["error"]
        assert error["param"] == "beam_width" and "cannot hold this request" in error["message"]
        assert "sequence" not in error["message"]
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_beam_searches_of_two_api_keys_never_share_a_prefix_with_salt_per_key():
    """--salt-per-key: tenant B's beam search of tenant A's prompt hits nothing (it hit every
    cached unit: the key's salt and the request's cache_salt were dropped for beam search);
    a key's own beam searches still share."""
    from vmemkv.runtime.serve.auth import AuthConfig
    keys = AuthConfig(api_keys=("key-a", "key-b"), metrics_key="ops", salt_per_key=True)
    body = dict(prompt=list(range(10, 58)), max_tokens=2, use_beam_search=True, n=2)
    with serving(dict(PAGED, prefix_sharing=True), auth=keys) as (server, engine):
        def hits(key, **extra):
            before = prefix_hits(server)
            r = local_http.post(server.url + "/v1/completions", json={**body, **extra}, timeout=60,
                                headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return prefix_hits(server) - before
        assert hits("key-a") == 0
        assert hits("key-b") == 0
        assert hits("key-a", cache_salt="mine") == 0     # a client's own salt is honoured
        assert hits("key-a") >= 40


def prefix_hits(server) -> float:
    text = local_http.get(server.url + "/metrics", headers={"Authorization": "Bearer ops"},
                          timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vmemkv:prefix_cache_hits_total"))


def test_a_large_length_penalty_is_answered_and_a_concurrent_stream_finishes():
    """length_penalty 2000 (finite, accepted) raised OverflowError in the engine step: the
    server aborted every live request (the concurrent stream ended with a 500 event)."""
    with serving(VMEM) as (server, engine):
        url = server.url + "/v1/completions"
        with local_http.stream("POST", url, timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "stream": True}) as s:
            beams = local_http.post(url, timeout=60, json={**BODY, "prompt": [4, 5, 6],
                                                      "length_penalty": 2000.0})
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert beams.status_code == 200, beams.text
        assert len(beams.json()["choices"]) == 2
        assert '"finish_reason": "length"' in lines[-1] and '"error"' not in "".join(lines)
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
