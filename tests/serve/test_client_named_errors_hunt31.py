"""The server hunt's (31) fixes: a 400 names what the client sent, where it sent it.

- ``logit_bias`` or ``stop_token_ids`` naming an id past the vocabulary was refused by the
  engine per prompt: "prompt 0: logit_bias names token ids ...", an index a chat request (one
  conversation, no ``prompt`` field) or a one-prompt completion never gave. It is a
  request-wide field: refused before anything is queued, naming it alone.
- One bad prompt of several (an id past the vocabulary, a lone surrogate, an empty one) was
  refused without saying which ("prompt has token ids [999] ..."), where every other refusal
  of one of several names its index.
- The engine's refusal of a request's one prompt (a cache resized below what the request needs:
  503) began "prompt 0 rejected: ", the engine's batch index, which a chat or one-prompt client
  never sent; with several prompts the index is the client's own and stays.
- A response past ``--max-response-bytes`` whose lever is its length named ``max_tokens`` though
  the chat client sent ``max_completion_tokens``: it names the field the client sent.
- A list of text prompts holding a token-id list was refused as "prompt[0]: Input should be a
  valid integer", pointing at a valid prompt (the union's first list form failed first): the
  message names where the list leaves its first entry's form, ``prompt[1]``.
- ``best_of`` below ``n`` (or 0) was "not supported: ranking hidden samples is not
  implemented", as if a valid request asked for a missing feature: it is never valid (vLLM:
  best_of must be at least n).
"""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.limits import ServeLimits
from vmemkv.runtime.serve.protocol import parse_completion_request

from ..engine.byte_tokenizer import byte_tokenizer
from . import local_http
from .conftest import (KiB, VMEM, assert_memory_at_baseline, serving,
                             wait_until_idle)

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as running:
        yield running


def _error(server, path: str, body) -> dict:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    answer = local_http.post(server.url + path, timeout=60, **kwargs)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logit_bias": {"300": 1}},
     "logit_bias", "logit_bias names token ids [300] outside the vocabulary [0, 256)"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stop_token_ids": [999, 7]},
     "stop_token_ids", "stop_token_ids names token ids [999] outside the vocabulary [0, 256)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"256": -5}},
     "logit_bias", "logit_bias names token ids [256] outside the vocabulary [0, 256)"),
    ("/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 2, "stop_token_ids": [400]},
     "stop_token_ids", "stop_token_ids names token ids [400] outside the vocabulary [0, 256)"),
])
def test_an_id_past_the_vocabulary_in_a_request_wide_field_names_no_prompt_index(
        server, path, body, param, message):
    running, engine = server
    error = _error(running, path, body)
    assert (error["param"], error["message"]) == (param, message)
    wait_until_idle(running)
    assert running.engine_thread.in_flight.total == 0
    assert_memory_at_baseline(engine)


@pytest.mark.parametrize("body, message", [
    ({"prompt": [[1, 2], [3, 999]], "max_tokens": 2},
     "prompt 1 has token ids [999] outside the vocabulary [0, 256)"),
    (b'{"prompt": ["a", "b", "\\udc00"], "max_tokens": 2}',
     "prompt 2 holds a lone surrogate (\\ud800-\\udfff escaped in JSON without its pair): not "
     "Unicode text"),
    ({"prompt": [[1], []], "max_tokens": 2},
     "prompt 1 is empty (every prompt needs at least 1 token or character)"),
    ({"prompt": ["a", "b", ""], "max_tokens": 2},
     "prompt 2 is empty (every prompt needs at least 1 token or character)"),
])
def test_one_bad_prompt_of_several_is_named_by_its_index(server, body, message):
    running, engine = server
    error = _error(running, "/v1/completions", body)
    assert (error["param"], error["message"]) == ("prompt", message)
    assert_memory_at_baseline(engine)


@pytest.mark.parametrize("prompt, message", [
    ([1, 999], "prompt has token ids [999] outside the vocabulary [0, 256)"),
    ("", "prompt: should have at least 1 item (an empty prompt or prompt list)"),
])
def test_a_lone_bad_prompt_is_named_without_an_index(server, prompt, message):
    running, _ = server
    error = _error(running, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert (error["param"], error["message"]) == ("prompt", message)


@pytest.mark.parametrize("n, best_of", [(3, 2), (1, 0), (2, -1)])
def test_best_of_below_n_is_refused_as_invalid_not_as_unsupported(n, best_of):
    request = parse_completion_request(
        f'{{"prompt": [1], "n": {n}, "best_of": {best_of}}}'.encode())
    with pytest.raises(ApiError) as caught:
        request.sampling_params()
    assert (caught.value.param, caught.value.message) == (
        "best_of", f"best_of must be at least n ({n}), got {best_of}")


def test_best_of_above_n_is_still_refused_as_unsupported():
    request = parse_completion_request(b'{"prompt": [1], "n": 1, "best_of": 3}')
    with pytest.raises(ApiError, match="ranking hidden samples is not implemented"):
        request.sampling_params()


# 4 pages (32 tokens of a sequence) now, 64 (max_context) once /resize grows it
SHRUNK = dict(VMEM, cache_bytes=16 * KiB, max_cache_bytes=512 * KiB, self_check=False)
NOT_NOW = ("{} prompt + 20 new tokens = {} tokens do not fit the cache at its current size "
           "(16384 bytes, 32 tokens of one sequence at most)")


def test_an_engine_refusal_of_the_one_prompt_names_no_batch_index():
    with serving(SHRUNK, tokenizer=byte_tokenizer(chat_template=True)) as (running, engine):
        chat = local_http.post(running.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 20})
        one = local_http.post(running.url + "/v1/completions", timeout=60, json={
            "prompt": list(range(1, 41)), "max_tokens": 20})
        two = local_http.post(running.url + "/v1/completions", timeout=60, json={
            "prompt": [list(range(1, 41))] * 2, "max_tokens": 20})
        assert [a.status_code for a in (chat, one, two)] == [503] * 3
        # "<user>" + 20 characters + "\n" + "<assistant>": 38 tokens of the byte tokenizer
        assert chat.json()["error"]["message"].startswith(NOT_NOW.format(38, 58))
        assert one.json()["error"]["message"].startswith(NOT_NOW.format(40, 60))
        assert two.json()["error"]["message"].startswith(
            "prompt 0 rejected: " + NOT_NOW.format(40, 60))
        wait_until_idle(running)
        assert running.engine_thread.in_flight.total == 0
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_a_response_past_the_limit_names_the_max_field_the_chat_client_sent(field):
    # 40 tokens of a streamed chat at the byte tokenizer's bound (432 bytes a token in its SSE
    # chunk) pass 10,000 bytes: the refusal named max_tokens though the client sent
    # max_completion_tokens
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True),
                 limits=ServeLimits(max_response_bytes=10_000)) as (running, engine):
        error = _error(running, "/v1/chat/completions",
                       {"messages": CHAT, field: 40, "stream": True})
        assert error["param"] == field
        assert error["message"].endswith(f"; {field} 19 or less fits")
        assert running.engine_thread.in_flight.total == 0
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("prompt, message", [
    (["a", [1, 2]], "prompt[1]: Input should be a valid string, got [1, 2]"),
    (["a", [1], "b"], "prompt[1]: Input should be a valid string, got [1]"),
    ([[1, 2], "a"], 'prompt[1]: Input should be a valid list, got "a"'),
    ([1, 2, "x"], 'prompt[2]: Input should be a valid integer, got "x"'),
])
def test_a_mixed_prompt_list_is_named_where_it_leaves_its_first_entrys_form(prompt, message):
    # a list of texts with a token-id list in it was "prompt[0]: Input should be a valid
    # integer", pointing at a valid text prompt (the union's first list form, failing first)
    with pytest.raises(ApiError) as refused:
        parse_completion_request(json.dumps({"prompt": prompt}).encode())
    assert (refused.value.param, refused.value.message) == ("prompt", message)
