"""The client side of ``vmemkv bench serve``: an open-loop load generator for any
OpenAI-compatible completions server.

Open loop: request i is sent at its arrival time (Poisson arrivals at ``rate`` per second, or a
bundled trace's own times), whether or not earlier ones have answered, as ``vllm bench serve``
does. Every request streams (``stream: true``); each SSE chunk that carries tokens is stamped
on the client's clock when it arrives, so TTFT, TPOT, ITL and E2EL are what a client sees.
Prompts are token ids (the OpenAI API takes them, so no tokenizer is needed on either side);
``ignore_eos`` makes each request produce exactly its output length. Every prompt is built before
the first is sent, so their tokens (``PROMPT_TOKEN_BYTES`` each) are checked against the host's
available memory first: a load that does not fit is a ``ServeConfigError`` naming the flags.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from vmemkv.scheduler import sim_memory
from vmemkv.scheduler.report import RequestTiming
from vmemkv.scheduler.traces import fit_to_length, load_trace, prompt_token_ids

from .errors import ServeConfigError


# host bytes a prompt token takes until its request is sent: 36 in the prompt's tuple (an int
# and its slot; tracemalloc, 2026-12-06, ids below 32,000), 8 in the list its body is built
# from and about 7 of the body's JSON, as much again while it is encoded (at rate inf every
# body is built at once), rounded up
PROMPT_TOKEN_BYTES = 64


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt, its output length and when to send it (s after start)."""
    prompt_ids: Tuple[int, ...]
    output_tokens: int
    arrival_s: float


@dataclass
class StreamResult:
    """What one streamed request got: token ids and arrival times per chunk (client clock)."""
    token_ids: List[int] = field(default_factory=list)
    token_times_s: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None     # HTTP status and message, or the exception, when it failed


def poisson_requests(rate: float, num_prompts: int, input_len: int, output_len: int,
                     vocab_size: int, seed: int = 0) -> List[BenchRequest]:
    """``num_prompts`` random-token prompts with exponential gaps of mean 1/rate (rate inf:
    all at time 0)."""
    for name, value, low in (("num_prompts", num_prompts, 1), ("input_len", input_len, 1),
                             ("output_len", output_len, 1), ("vocab_size", vocab_size, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ServeConfigError(f"{name} must be an int >= {low}, got {value!r}")
    if not rate > 0:
        raise ServeConfigError(f"rate must be > 0 requests/s (inf: all at once), got {rate!r}")
    check_prompts_fit(num_prompts * input_len,
                      f"num_prompts {num_prompts:,} x input_len {input_len:,} "
                      f"(--num-prompts x --input-len)", "lower --num-prompts or --input-len")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(num_prompts):
        ids = tuple(rng.randrange(vocab_size) for _ in range(input_len))
        out.append(BenchRequest(ids, output_len, t))
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return out


def trace_requests(name: str, max_requests: int, rate_scale: float, max_total_len: int,
                   vocab_size: int, seed: int = 0) -> List[BenchRequest]:
    """The first ``max_requests`` of a bundled trace (or trace file), arrivals divided by
    ``rate_scale``, requests longer than ``max_total_len`` scaled down to it. Mooncake prompts
    keep their shared blocks (equal hash ids, equal tokens); others are random tokens."""
    entries, _ = fit_to_length(load_trace(name, rate_scale=rate_scale, max_requests=max_requests),
                               max_total_len)
    check_prompts_fit(sum(e.prompt_len for e in entries),
                      f"the {len(entries):,} requests of trace {name} (--max-requests "
                      f"{max_requests}, --max-total-len {max_total_len:,})",
                      "lower --max-requests or --max-total-len")
    rng, start = random.Random(seed), entries[0].arrival_s if entries else 0.0
    out = []
    for e in entries:
        ids = (prompt_token_ids(e, vocab_size, seed=seed) if e.hash_ids
               else tuple(rng.randrange(vocab_size) for _ in range(e.prompt_len)))
        out.append(BenchRequest(ids, e.output_len, e.arrival_s - start))
    return out


def check_prompts_fit(prompt_tokens: int, what: str, remedy: str) -> None:
    """ServeConfigError, before any prompt is built, when ``prompt_tokens`` prompt tokens
    (``PROMPT_TOKEN_BYTES`` each) need more than the host's available memory."""
    need_bytes = prompt_tokens * PROMPT_TOKEN_BYTES
    available_bytes = sim_memory.available_bytes()
    if available_bytes is not None and need_bytes > available_bytes:
        raise ServeConfigError(
            f"{what} is {prompt_tokens:,} prompt tokens, built before the first request is sent: "
            f"about {need_bytes} bytes ({need_bytes / 2**30:.2f} GiB) of host memory, more than "
            f"the host MemAvailable of {available_bytes} bytes ({available_bytes / 2**30:.2f} "
            f"GiB); {remedy}")


async def stream_completion(client, url: str, body: dict,
                            stop_after_tokens: Optional[int] = None) -> StreamResult:
    """POST a streaming completion to ``url`` and read its SSE chunks; with
    ``stop_after_tokens`` the client hangs up after that many tokens (a disconnect)."""
    result = StreamResult()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if _take_chunk(line, result) or (stop_after_tokens is not None
                                                 and len(result.token_ids) >= stop_after_tokens):
                    break
    except Exception as error:   # noqa: BLE001 -- a failed request is a figure, not a crash
        result.error = f"{type(error).__name__}: {error}"
    return result


def _take_chunk(line: str, result: StreamResult) -> bool:
    """Record one SSE line; True at ``[DONE]``."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:   # OpenAI's {"error": {"message": ...}}, or TGI's {"error": "..."}
        error = chunk["error"]
        result.error = str(error.get("message") if isinstance(error, dict) else error)
        return True
    now = time.perf_counter()
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids")
        count = len(ids) if ids is not None else int(bool(choice.get("text")))
        result.token_ids.extend(ids or [])
        result.token_times_s.extend([now] * count)
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return False


async def run_load(base_url: str, model: str, requests: Sequence[BenchRequest],
                   timeout_s: float = 600.0) -> Tuple[List[RequestTiming], List[str], float]:
    """Send ``requests`` open-loop; (timings of the completed ones, errors, duration in s)."""
    import httpx
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest) -> Tuple[float, StreamResult]:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            sent = time.perf_counter()
            body = {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.output_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            return sent, await stream_completion(client, url, body)

        results = await asyncio.gather(*(one(r) for r in requests))
        duration_s = time.perf_counter() - start
    timings, errors = [], []
    for req, (sent, res) in zip(requests, results):
        if res.error or not res.token_times_s:
            errors.append(res.error or "no tokens")
        else:
            timings.append(RequestTiming(sent, tuple(res.token_times_s), len(req.prompt_ids)))
    return timings, errors, duration_s


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id ``GET /v1/models`` lists (ServeConfigError when unreachable)."""
    import httpx
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ServeConfigError(f"cannot list the models of {base_url!r}: {error}; pass --model "
                               f"or check --url") from None
