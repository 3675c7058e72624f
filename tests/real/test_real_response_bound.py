"""``--max-response-bytes`` is a true bound on SmolLM2's real tokens: its longest, 46778 (a
newline and 80 spaces), forced with logit_bias, with echo and logprobs (completions) or top
logprobs and their ``bytes`` lists (chat). The hunt (2026-12-07) got 2.6 MB past a 1 MiB
limit that way, the estimate taking 16 bytes a token and 80 a logprob entry; the bound is now
the served tokenizer's (``limits.ResponseBounds``)."""
from __future__ import annotations

import json
import re

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.serve.limits import ResponseBounds

from ..serve import local_http
from .conftest import ENGINE

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def bound_server(real_model):
    from vmemkv.runtime.serve import Server
    model, tokenizer = real_model
    with Engine(model, tokenizer, **ENGINE) as engine:
        with Server(engine, MODEL, port=0).start() as server:
            yield server, tokenizer


def _longest_token(tokenizer) -> int:
    sizes = [len(json.dumps(tokenizer.decode([i]), ensure_ascii=False).encode())
             for i in range(len(tokenizer))]
    return max(range(len(sizes)), key=sizes.__getitem__)


def _post(server, path: str, body: dict, limit_bytes: int):
    server.engine_thread.max_response_bytes = limit_bytes    # what each Submission reads
    return local_http.post(server.url + path, json=body, timeout=120)


def test_the_longest_token_forced_never_passes_the_limit_that_admitted_it(bound_server):
    server, tokenizer = bound_server
    longest = _longest_token(tokenizer)
    assert longest == 46778 and tokenizer.decode([longest]) == "\n" + " " * 80
    forced = {str(longest): 100}
    shapes = [("/v1/completions", {"prompt": [longest] * 48, "max_tokens": 6, "echo": True,
                                   "logprobs": 3, "logit_bias": forced, "temperature": 0}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
                                        "logit_bias": forced, "temperature": 0})]
    for path, body in shapes:
        answered = _post(server, path, body, 2**30)
        assert answered.status_code == 200, answered.text
        choice = answered.json()["choices"][0]
        assert choice["token_ids"] == [longest] * 6            # forced: the worst token
        actual_bytes = len(answered.content)
        refused = _post(server, path, body, actual_bytes - 1)   # one byte short: refused
        assert refused.status_code == 400, (path, actual_bytes, refused.text[:300])
        message = refused.json()["error"]["message"]
        estimate_bytes = int(re.search(r"could reach about ([\d,]+) bytes", message)[1]
                             .replace(",", ""))
        admitted = _post(server, path, body, estimate_bytes)   # the least limit admitting it
        assert admitted.status_code == 200
        assert actual_bytes <= estimate_bytes and len(admitted.content) <= estimate_bytes


def test_the_bound_counts_the_longest_tokens_json_and_bytes(real_model):
    _, tokenizer = real_model
    bounds = ResponseBounds.of(tokenizer, len(tokenizer))
    # 46778: 82 JSON bytes ("\n" is 2), 81 bytes (its bytes list: up to 4 a byte)
    assert bounds.completion.token_bytes == (82 + 1) + (5 + 1)
    assert bounds.completion.entry_bytes == 82 + 24 + 4
    assert bounds.chat.entry_bytes == 82 + 24 + (4 * 81 + 1) + 34
