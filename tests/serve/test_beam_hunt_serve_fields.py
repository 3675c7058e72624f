"""Beam-search fields over HTTP (hunt_beam's reproductions).

- ``skip_special_tokens: false`` with ``use_beam_search`` was taken (200) and ignored: a beam's
  text always left special tokens out. It now reaches ``BeamSearchParams`` from completions and
  chat, and the choices' text keeps them, as plain decoding's does.
- A 400 for a beam field named the engine's class in its message ("BeamSearchParams.
  stop_token_ids [300] lie outside the vocabulary ..."), from the request check and from the
  engine thread's refusal alike: the message names the field as the client sent it.
"""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.serve.chat import parse_chat_request
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.protocol import parse_completion_request

from . import local_http
from ..engine.byte_tokenizer import CHAT_TEMPLATE
from ..engine.test_beam_hunt_fixes import special_byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving, wait_until_idle

BEAMS = {"use_beam_search": True, "n": 1, "beam_width": 2, "ignore_eos": True}
APIS = {"completions": (parse_completion_request, {"prompt": [1, 2, 3], "max_tokens": 2},
                        lambda req: req.sampling_params()),
        "chat": (parse_chat_request, {"messages": [{"role": "user", "content": "x"}]},
                 lambda req: req.sampling_params(2))}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("api", list(APIS))
def test_skip_special_tokens_reaches_a_beam_search(api, skip):
    parse, base, params = APIS[api]
    body = {**base, **BEAMS, "skip_special_tokens": skip}
    assert params(parse(json.dumps(body).encode())).skip_special_tokens is skip
    assert params(parse(json.dumps({**base, **BEAMS}).encode())).skip_special_tokens is True


@pytest.mark.parametrize("api", list(APIS))
def test_a_beam_field_refused_by_the_request_check_is_named_as_sent(api):
    parse, base, params = APIS[api]
    with pytest.raises(ApiError) as refused:
        params(parse(json.dumps({**base, **BEAMS, "stop_token_ids": [-1]}).encode()))
    assert (refused.value.status, refused.value.param) == (400, "stop_token_ids")
    assert refused.value.message == ("stop_token_ids must be a sequence of at most 1024 int "
                                     "token ids >= 0, got (-1,)")


@pytest.fixture(scope="module")
def server():
    tokenizer = special_byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    with serving(VMEM, tokenizer=tokenizer) as running:
        yield running


@pytest.mark.parametrize("skip", [True, False])
def test_beam_choices_keep_special_tokens_when_asked_completions_and_chat(server, skip):
    running, engine = server
    tokenizer = special_byte_tokenizer()
    completion = local_http.post(running.url + "/v1/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 8, **BEAMS, "skip_special_tokens": skip})
    assert completion.status_code == 200, completion.text
    (choice,) = completion.json()["choices"]
    assert any(t >= 128 for t in choice["token_ids"])             # special tokens in the beam
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=skip)
    assert (choice["text"] == tokenizer.decode(choice["token_ids"])) is not skip
    chat = local_http.post(running.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **BEAMS,
        "skip_special_tokens": skip})
    assert chat.status_code == 200, chat.text
    (choice,) = chat.json()["choices"]
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"],
                                                            skip_special_tokens=skip)
    wait_until_idle(running)
    assert_memory_at_baseline(engine)


@pytest.mark.parametrize("extra, param, message", [
    ({"stop_token_ids": [300]}, "stop_token_ids",
     "stop_token_ids [300] lie outside the vocabulary [0, 256)"),
    ({"stop_token_ids": list(range(200))}, "beam_width",
     "beam_width 2 needs 402 candidates a step, more than the vocabulary's 256 tokens"),
])
def test_a_beam_field_the_engine_refuses_is_named_as_sent(server, extra, param, message):
    running, engine = server
    answer = local_http.post(running.url + "/v1/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 4, **BEAMS, **extra})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["message"]) == (param, message)     # not "BeamSearchParams."
    wait_until_idle(running)
    assert_memory_at_baseline(engine)
