"""A bounded load test on loopback: 200 concurrent streaming requests, one client in ten hanging
up mid-stream. Every other request completes with Engine.generate's tokens, the disconnects are
aborted, pages / blocks / swap space return to baseline and the server stays up. Bounded: a
fixed request count, and ``asyncio.wait_for`` ends it if the server stalls."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.serve.bench_client import stream_completion

from . import local_http
from .conftest import KiB, PAGED, VMEM, assert_memory_at_baseline, model, prompts, serving, wait_until_idle

REQUESTS, EVERY = 200, 10        # every 10th client disconnects
NEW_TOKENS, LONG_TOKENS = 6, 40  # disconnecting clients ask for more, so they are still running
SMALL_VMEM = dict(VMEM, max_batch=16, cache_bytes=64 * KiB)   # 4 page groups: requests queue
SWAP_PAGED = dict(PAGED, max_batch=16, cache_bytes=48 * KiB, preemption="swap",
                  swap_bytes=256 * KiB)                        # 96 blocks: dozens of swap-outs


def metric(text: str, name: str) -> float:
    """``name``'s value, summed over its series (request_success_total's finished_reasons)."""
    values = re.findall(rf"^vmemkv:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert values, name
    return sum(map(float, values))


async def load(url: str, batch) -> list:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i: int, prompt):
            leaves = i % EVERY == 0
            body = {"prompt": prompt, "temperature": 0, "ignore_eos": True,
                    "max_tokens": LONG_TOKENS if leaves else NEW_TOKENS}
            return await stream_completion(client, url + "/v1/completions", body,
                                           stop_after_tokens=2 if leaves else None)
        return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(batch))), 120)


@pytest.mark.parametrize("options", [SMALL_VMEM, SWAP_PAGED], ids=["vmem", "paged-swap"])
def test_200_streams_with_disconnects_end_exact_and_release_everything(options):
    batch = prompts(REQUESTS, 3, 12, seed=5)
    with Engine(model(), **options) as reference:
        want = reference.generate(batch, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    with serving(options) as (server, engine):
        results = asyncio.run(load(server.url, batch))
        wait_until_idle(server)
        for i, result in enumerate(results):
            assert result.error is None, (i, result.error)
            if i % EVERY:
                assert result.token_ids == want[i].outputs[0].token_ids, i
                assert result.finish_reason == "length"
            else:
                assert len(result.token_ids) == 2
        text = local_http.get(server.url + "/metrics").text
        aborted, finished = metric(text, "num_aborted_requests_total"), metric(text, "request_success_total")
        assert aborted + finished == REQUESTS and aborted >= 1
        assert metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0
        assert_memory_at_baseline(engine)
        assert local_http.get(server.url + "/health").status_code == 200
        again = local_http.post(server.url + "/v1/completions", json={"prompt": batch[1], "max_tokens":
                                NEW_TOKENS, "temperature": 0, "ignore_eos": True}).json()
        assert again["choices"][0]["token_ids"] == want[1].outputs[0].token_ids


def test_a_disconnect_aborts_the_request_and_returns_its_memory():
    with serving(dict(VMEM, max_context=1024)) as (server, engine):
        async def leave_after_one():
            async with httpx.AsyncClient(timeout=30) as client:
                return await stream_completion(client, server.url + "/v1/completions",
                                               {"prompt": [1, 2, 3], "max_tokens": 1000,
                                                "temperature": 0, "ignore_eos": True},
                                               stop_after_tokens=1)
        assert len(asyncio.run(leave_after_one()).token_ids) == 1
        wait_until_idle(server)
        text = local_http.get(server.url + "/metrics").text
        assert metric(text, "num_aborted_requests_total") == 1
        assert metric(text, "request_success_total") == 0
        assert metric(text, "generation_tokens_total") < 1000
        assert_memory_at_baseline(engine)
