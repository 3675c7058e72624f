"""vLLM's ``stop_reason`` in every choice of /v1/completions and /v1/chat/completions, streamed
(each choice's last chunk) and not: the stop string that ended the choice, the
``stop_token_ids`` id, null for a choice ended by its length. The response limit counts the
longest stop string once per choice, so the field can never take a response past it."""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.serve.limits import TokenBytes
from vmemkv.runtime.serve.submission import response_size
from vmemkv.runtime.engine.sampling import SamplingParams

from ..engine.byte_tokenizer import byte_tokenizer
from . import local_http
from .conftest import VMEM, serving

X, Y = ord("x"), ord("y")
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as running:
        yield running[0]


def post(server, path: str, body: dict):
    answer = local_http.post(server.url + path, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def streamed_last(server, path: str, body: dict) -> dict:
    """The last chunk with a finish_reason, of a streamed response."""
    answer = post(server, path, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {")]
    ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(ends) == 1
    return ends[0]


@pytest.mark.parametrize("path, base", [
    ("/v1/completions", {"prompt": "ab"}),
    ("/v1/chat/completions", {"messages": CHAT}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("fields, finish, reason", [
    ({"logit_bias": {str(X): 100}, "stop": ["zz", "xx"]}, "stop", "xx"),
    ({"logit_bias": {str(Y): 100}, "stop_token_ids": [Y]}, "stop", Y),
    ({"logit_bias": {str(X): 100}}, "length", None),
], ids=["string", "token-id", "length"])
def test_each_choice_says_what_stopped_it(server, path, base, fields, finish, reason):
    body = {**base, **fields, "max_tokens": 4, "ignore_eos": True, "n": 2}
    for choice in post(server, path, body).json()["choices"]:
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason)
    last = streamed_last(server, path, {**body, "n": 1})
    assert (last["finish_reason"], last["stop_reason"]) == (finish, reason)


def test_the_response_limit_counts_the_longest_stop_string_per_choice():
    long = "\u00e9" * 1000                       # 6 bytes a character ASCII-escaped
    plain = response_size([[1, 2]], SamplingParams(max_new_tokens=4, n=3), bound=TokenBytes())
    stopped = response_size([[1, 2]], SamplingParams(max_new_tokens=4, n=3, stop=["a", long]),
                            bound=TokenBytes())
    assert stopped.estimate_bytes - plain.estimate_bytes == 3 * len(json.dumps(long))
