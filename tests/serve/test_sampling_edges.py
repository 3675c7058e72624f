"""Edge floats over HTTP never hurt anyone (issue 27, item 1): temperature 1e-300 / 5e-324 and
top_p 1e-300 answered 500 on main and aborted every live request. Every edge value of every
float field of both APIs is now a 200 or a 400 naming the field, and a concurrent victim's tokens
equal its solo run."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving, wait_until_idle

EDGES = ["0", "-0.0", "5e-324", "1e-300", "1e-38", "1e-6", "0.5", "1", "2", "100", "3.4e38",
         "1e308", "-1e-300", "-1", "-1e308"]
FIELDS = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty"]
VICTIM = {"prompt": [5, 9, 2, 7], "max_tokens": 60, "temperature": 0.8, "seed": 17,
          "ignore_eos": True, "stream": True}


async def _victim_tokens(client, url: str) -> list:
    ids = []
    async with client.stream("POST", url + "/v1/completions", json=VICTIM) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0]["token_ids"]
    return ids


async def _attack(client, url: str) -> list:
    async def one(field, value, path, body):
        content = body + f', "max_tokens": 2, "{field}": {value}, "ignore_eos": true}}'
        r = await client.post(url + path, content=content, headers={"Content-Type": "application/json"})
        return field, value, path, r.status_code, r.json()
    chat = ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]')
    cases = [(f, v, "/v1/completions", '{"prompt": [1, 2, 3]') for f in FIELDS for v in EDGES]
    cases += [(f, v, *chat) for f in FIELDS[:2] for v in EDGES]   # the same rules: a sample
    statuses = []
    for start in range(0, len(cases), 30):   # 30 at a time: they batch in the engine
        statuses += await asyncio.gather(*(one(*c) for c in cases[start:start + 30]))
    return statuses


def test_edge_floats_are_200_or_400_and_leave_a_victim_untouched():
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, engine):
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                solo = await _victim_tokens(client, server.url)
                victim = asyncio.ensure_future(_victim_tokens(client, server.url))
                statuses = await _attack(client, server.url)
                return solo, await victim, statuses
        solo, during, statuses = asyncio.run(run())
        assert during == solo and len(solo) == 60
        for field, value, path, status, body in statuses:
            assert status in (200, 400), (field, value, path, status, body)
            if status == 400:
                assert body["error"]["param"] == field, (field, value, body)
            else:
                assert len(body["choices"][0]["token_ids"]) == 2
        accepted = {(f, v) for f, v, _, s, _ in statuses if s == 200}
        assert {("temperature", "5e-324"), ("temperature", "1e-300"), ("top_p", "1e-300")} <= accepted
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("field,value", [("temperature", 1e-300), ("temperature", 5e-324),
                                         ("top_p", 1e-300)])
def test_the_issue_values_are_greedy_answers(field, value):
    with serving(VMEM) as (server, _):
        greedy = local_http.post(server.url + "/v1/completions", json={
            "prompt": [3, 1, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        body = {"prompt": [3, 1, 4], "max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                field: value}
        got = local_http.post(server.url + "/v1/completions", json=body)
    assert got.status_code == 200
    assert got.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_min_tokens_with_every_token_a_stop_id_is_a_400_naming_min_tokens(temperature):
    """stop_token_ids (with EOS) covering the whole vocabulary and min_tokens > 0 left no token
    to draw: sampled, a 500 (torch.multinomial on all -inf); greedy, token 0 (a stop id) ended
    the choice at once despite min_tokens. Refused before anything is queued; one id left
    free, min_tokens holds."""
    body = {"prompt": [1, 2], "max_tokens": 4, "min_tokens": 2, "temperature": temperature}
    everything_but_eos = [t for t in range(256) if t != 2]   # tiny-llama's EOS is 2
    with serving(VMEM) as (server, engine):
        url = server.url + "/v1/completions"
        for stops, extra in [(list(range(256)), {}), (everything_but_eos, {})]:
            r = local_http.post(url, json={**body, **extra, "stop_token_ids": stops}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        r = local_http.post(url, timeout=60, json={**body, "stop_token_ids": everything_but_eos,
                                              "ignore_eos": True})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["token_ids"][:2] == [2, 2] and choice["finish_reason"] == "stop"
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
