"""Completions through the server equal ``Engine.generate`` on the same requests: greedy and
seeded sampling, with and without streaming, sent concurrently so they batch; the official
``openai`` client reads both forms; /v1/models and /health answer."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.serve.bench_client import stream_completion

from . import local_http
from .conftest import NAME, PAGED, VMEM, assert_memory_at_baseline, model, prompts, serving, wait_until_idle

GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = dict(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, n=2, seed=7, ignore_eos=True)


def engine_tokens(options: dict, batch, body: dict) -> list[list[list[int]]]:
    """Per prompt, per sample: what Engine.generate gives for the request ``body`` describes."""
    params = SamplingParams(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                            top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0),
                            n=body.get("n", 1), seed=body.get("seed"), ignore_eos=True)
    with Engine(model(), **options) as engine:
        return [[o.token_ids for o in out.outputs] for out in engine.generate(batch, params)]


async def send_all(url: str, batch, body: dict, stream: bool) -> list[list[list[int]]]:
    async with httpx.AsyncClient(timeout=60) as client:
        if stream:
            results = await asyncio.gather(*(_streamed(client, url, p, body) for p in batch))
        else:
            responses = await asyncio.gather(*(client.post(url + "/v1/completions",
                                                           json={**body, "prompt": p}) for p in batch))
            results = []
            for r in responses:
                assert r.status_code == 200, r.text
                choices = sorted(r.json()["choices"], key=lambda c: c["index"])
                assert all(c["finish_reason"] == "length" for c in choices)
                results.append([c["token_ids"] for c in choices])
    return results


async def _streamed(client, url: str, prompt, body: dict) -> list[list[int]]:
    """Token ids per choice, from the SSE chunks (each names its choice index)."""
    per_choice: dict[int, list[int]] = {}
    async with client.stream("POST", url + "/v1/completions",
                             json={**body, "prompt": prompt, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line[5:])["choices"]:
            per_choice.setdefault(c["index"], []).extend(c["token_ids"])
    return [per_choice[i] for i in sorted(per_choice)]


@pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("body", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampling-n2"])
def test_served_tokens_equal_engine_generate(options, stream, body):
    batch = prompts(6, 3, 20, seed=11)
    want = engine_tokens(options, batch, body)
    with serving(options) as (server, engine):
        got = asyncio.run(send_all(server.url, batch, body, stream))
        wait_until_idle(server)
        assert got == want
        assert_memory_at_baseline(engine)


def test_stream_usage_chunk_counts_the_tokens():
    with serving(VMEM) as (server, _):
        body = {**GREEDY, "prompt": [5, 6, 7], "stream": True,
                "stream_options": {"include_usage": True}}
        with local_http.stream("POST", server.url + "/v1/completions", json=body) as response:
            chunks = [json.loads(line[5:]) for line in response.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
    assert [len(c["choices"]) for c in chunks] == [1] * 10 + [0]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


def test_the_openai_client_reads_completions_and_streams():
    openai = pytest.importorskip("openai")
    batch = prompts(2, 4, 8, seed=3)
    want = engine_tokens(VMEM, batch, GREEDY)
    with serving(VMEM) as (server, _):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [NAME]
        done = client.completions.create(model=NAME, prompt=batch[0], max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].text == " ".join(map(str, want[0][0]))
        assert done.usage.completion_tokens == 10 and done.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model=NAME, prompt=batch[1], max_tokens=10,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == " ".join(map(str, want[1][0]))


def test_models_and_health():
    with serving(PAGED) as (server, _):
        models = local_http.get(server.url + "/v1/models").json()
        assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == 64
        assert local_http.get(server.url + "/health").status_code == 200


def test_bench_client_stream_reads_every_token():
    with serving(VMEM) as (server, _):
        async def one():
            async with httpx.AsyncClient(timeout=30) as client:
                return await stream_completion(client, server.url + "/v1/completions",
                                               {**GREEDY, "prompt": [1, 2, 3]})
        result = asyncio.run(one())
    assert result.error is None and len(result.token_ids) == len(result.token_times_s) == 10
    assert result.finish_reason == "length"
    assert result.token_times_s == sorted(result.token_times_s)
