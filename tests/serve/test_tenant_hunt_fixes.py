"""What the tenant hunt (2026-12-07) found, fixed:

* ``--max-response-bytes`` was estimated at 16 bytes a token and 80 a logprob entry, measured on
  1- to 3-character tokens: SmolLM2's token 46778 ("\\n" and 80 spaces) forced with echo or
  logit_bias gave 2.6 MB against a 1 MiB limit. The bound is now the served tokenizer's own
  (``limits.ResponseBounds``, from its longest token): here a handmade tokenizer whose tokens
  are up to 361 JSON bytes, answered by a fake engine thread, never passes the limit that
  admitted it, and one byte less of limit refuses it.
* The response budget's 503 said how many bytes the server held: with ``--salt-per-key`` one
  tenant read another's request size there. It names only the budget and this request's size.
* ``/metrics`` counts every tenant's tokens and prefix hits: with ``--salt-per-key`` a tenant's
  key no longer opens it (403 naming why); the admin or metrics key does.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
from concurrent.futures import Future

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.auth import AuthConfig, Guard
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import Token
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.limits import ServeLimits
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.submission import ResponseBudget

from ..engine.byte_tokenizer import CHAT_TEMPLATE, _byte_chars
from .test_app_submission import finished

LOGPROB = -1.2345678901234567e-300     # the longest float JSON writes: 24 bytes
CHARS = _byte_chars()
# the long tokens: a newline and 200 spaces (202 JSON bytes, 201 bytes), 60 U+0001 and a letter
# (361 JSON bytes: each is "\\u0001"), 100 "é" (200 bytes, 200 JSON bytes: 100 two-byte chars)
LONG_TEXTS = ["\n" + " " * 200] + ["\x01" * 60 + c for c in "abcd"] + ["é" * 100]


@functools.lru_cache(maxsize=None)
def long_token_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (ids 0-255 are the bytes) with the long tokens from id 256 on."""
    vocab = {CHARS[b]: b for b in range(256)}
    for text in LONG_TEXTS:
        vocab["".join(CHARS[b] for b in text.encode())] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    return fast


LONG_IDS = list(range(256, 256 + len(LONG_TEXTS)))


class LongTokenEngineThread:
    """Answers every request at once with max_tokens long tokens per sample, each with k top
    logprobs of other long tokens (and the prompt's, when asked for)."""
    alive = True

    def __init__(self, max_response_bytes: int) -> None:
        self.max_response_bytes, self.response_budget = max_response_bytes, None
        self.submitted = []

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        self.submitted.append(list(ids))
        request_id, k = len(self.submitted), params.logprobs
        tokenizer = long_token_tokenizer()

        def entry(token_id):
            if k is None:
                return None
            return TokenLogprobs(token_id, LOGPROB, 1, tuple((t, LOGPROB) for t in LONG_IDS[:k]))
        prompt = None if params.prompt_logprobs is None else [None] + [entry(t) for t in ids[1:]]
        for sample in range(params.n):
            for i in range(params.max_new_tokens):
                token_id, last = LONG_IDS[i % len(LONG_IDS)], i == params.max_new_tokens - 1
                event = TokenEvent(request_id, sample, token_id, last, "length" if last else None,
                                   tokenizer.decode([token_id]), entry(token_id))
                sink(Token(event, 0.0, prompt if sample == i == 0 else None))
        return finished(sink, request_id)

    def abort(self, request_id) -> None:
        pass


def _post(path: str, body: dict, max_response_bytes: int) -> httpx.Response:
    tokenizer = long_token_tokenizer()
    served = ServedModel("m", tokenizer, len(tokenizer), 4096, 8)
    app = create_app(LongTokenEngineThread(max_response_bytes), ServeMetrics("m"), served)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=10)
    return asyncio.run(run())


PROMPT = LONG_IDS * 8          # 48 long prompt tokens
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [PROMPT, PROMPT[:5]], "max_tokens": 30, "n": 2,
                         "echo": True, "logprobs": 5}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "echo": True}),
    ("/v1/completions", {"prompt": PROMPT[:3], "max_tokens": 60}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "logprobs": True,
                              "top_logprobs": 5, "n": 3}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "logprobs": True}),
], ids=["echo-logprobs", "echo", "plain", "chat-top5", "chat-top0"])
def test_no_response_passes_the_limit_that_admitted_it_with_long_tokens(path, body):
    answered = _post(path, body, 2**30)
    assert answered.status_code == 200, answered.text
    actual_bytes = len(answered.content)
    # a limit one byte under the answer: the bound must refuse it (it took 16 bytes a token)
    refused = _post(path, body, actual_bytes - 1)
    assert refused.status_code == 400, (actual_bytes, refused.text[:300])
    message = refused.json()["error"]["message"]
    assert "(--max-response-bytes)" in message
    estimate_bytes = int(re.search(r"could reach about ([\d,]+) bytes", message)[1]
                         .replace(",", ""))
    assert actual_bytes <= estimate_bytes <= 2 * actual_bytes   # true, and not far above
    admitted = _post(path, body, estimate_bytes)     # the limit at the estimate admits it
    assert admitted.status_code == 200 and len(admitted.content) == actual_bytes


def test_the_budget_refusal_never_tells_what_other_requests_hold(caplog):
    budget = ResponseBudget(1_000_000)
    budget.reserve(261_072)                  # another tenant's request: 777 x (16 + 4 x 80)
    with caplog.at_level(logging.WARNING, logger="vmemkv.serve"):
        with pytest.raises(ApiError) as refused:
            budget.reserve(800_000)
    message = refused.value.message
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "261,072" not in message and "261072" not in message
    assert "738,928" not in message           # nor what is left of the budget
    assert "1,000,000 bytes" in message and "800,000" in message      # its total, its own size
    assert "261072 of the 1000000-byte response budget" in caplog.text  # the operator's log has it
    assert budget.held_bytes == 261_072       # nothing reserved for the refused one


async def _metrics_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"vmemkv:prompt_tokens_total 37"})


def _get_metrics(auth: AuthConfig, key) -> httpx.Response:
    guard = Guard(_metrics_app, ServeLimits(), auth)

    async def run():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            return await client.get("/metrics", headers=headers, timeout=10)
    return asyncio.run(run())


@pytest.mark.parametrize("admin_key", [None, "operator-z"])
def test_with_salt_per_key_a_tenants_key_never_reads_metrics(admin_key):
    # /metrics gave tenant A tenant B's prompt and generated tokens and prefix hits
    auth = AuthConfig(("tenant-a", "tenant-b"), salt_per_key=True, admin_key=admin_key)
    refused = _get_metrics(auth, "tenant-a")
    assert refused.status_code == 403
    message = refused.json()["error"]["message"]
    assert "every tenant" in message and "--salt-per-key" in message
    assert "--admin-key" in message and "--metrics-key" in message
    assert _get_metrics(auth, None).status_code == (401 if admin_key else 403)
    assert _get_metrics(auth, "wrong").status_code == (401 if admin_key else 403)
    if admin_key:
        assert _get_metrics(auth, admin_key).status_code == 200


def test_the_metrics_key_opens_metrics_and_without_salt_per_key_an_api_key_does():
    tenants = AuthConfig(("tenant-a",), salt_per_key=True, metrics_key="ops")
    assert _get_metrics(tenants, "ops").status_code == 200
    assert _get_metrics(tenants, "tenant-a").status_code == 401     # as before: its own key
    shared = AuthConfig(("team-key",))             # one team's keys: no tenants to tell apart
    assert _get_metrics(shared, "team-key").status_code == 200
