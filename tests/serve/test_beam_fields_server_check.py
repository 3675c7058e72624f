"""The beam-search fields as the server's request check takes them, before anything is queued.

- ``"beam_width": null`` is the field left out, as in every other field OpenAI or vLLM type
  "X or null": it was a 400 ("beam_width needs use_beam_search: true") without
  ``use_beam_search``. A beam_width that is not null still needs use_beam_search.
- A search whose beams cannot make their first decode step (each beam's own copy of its newest
  block does not fit beside the prompt's) while fewer beams can is a 400 naming ``beam_width``
  (``n`` where the width defaults to it): no smaller max_tokens that still decodes fits. It
  named ``max_tokens`` with "this model's context is 50 tokens".
- ``beam_width`` past ``--max-batch`` is refused by the request check naming it and the limit;
  it was queued and refused by the engine thread ("BeamSearchParams.beam_width 5 exceeds
  max_batch 4"), or, far past it, named ``max_tokens`` from the length check.

tiny-llama on paged 8-token blocks, an 8-block (32 KiB) pool, ``--max-batch`` 4: after a
49-token prompt the first decode step (50 tokens) holds the 6 whole blocks before the newest
once and one block per beam, so 2 beams fit (8 blocks) and 3 do not (9).
"""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve.chat import chat_token_ids, parse_chat_request
from vmemkv.runtime.serve.completions import ServedModel, prompt_token_ids
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.protocol import parse_completion_request

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import serving

OPTIONS = dict(cache="paged", block_size=8, max_batch=4, max_context=64,
               cache_bytes=8 * 4096, self_check=False)     # 8 blocks of 4 KiB
PROMPT = list(range(3, 52))                                 # 49 tokens
MESSAGES = [{"role": "user", "content": "x" * 31}]          # 49 tokens rendered
BEAMS = {"use_beam_search": True, "ignore_eos": True}
FIRST_STEP = ("the server's KV cache cannot hold a beam search of 3 beams ({param}) over a "
              "49-token prompt at its first decode step, where each beam holds its own copy of "
              "its newest token's cache unit; the most beams that can decode after this prompt: 2")
PAST_MAX_BATCH = ("{param} must be at most 4 (the server's --max-batch: a step runs all the "
                  "beams of a search together), got {width}")
APIS = {"completions": (parse_completion_request, {"prompt": [1, 2, 3], "max_tokens": 2},
                        lambda req: req.sampling_params()),
        "chat": (parse_chat_request, {"messages": [{"role": "user", "content": "x"}]},
                 lambda req: req.sampling_params(2))}


@pytest.mark.parametrize("api", list(APIS))
def test_a_null_beam_width_is_the_field_left_out_with_or_without_use_beam_search(api):
    parse, base, params = APIS[api]
    plain = params(parse(json.dumps(base).encode()))
    nulled = parse(json.dumps({**base, "beam_width": None}).encode())
    assert "beam_width" not in nulled.model_fields_set
    assert isinstance(plain, SamplingParams) and params(nulled) == plain
    beams = params(parse(json.dumps({**base, **BEAMS, "n": 2, "beam_width": None}).encode()))
    assert isinstance(beams, BeamSearchParams)
    assert (beams.beam_width, beams.returned_beams) == (2, 2)      # the default: n
    with pytest.raises(ApiError) as refused:                       # a value still needs it
        params(parse(json.dumps({**base, "beam_width": 2}).encode()))
    assert (refused.value.status, refused.value.param) == (400, "beam_width")
    assert refused.value.message == "beam_width needs use_beam_search: true"


@pytest.fixture(scope="module")
def server():
    with serving(OPTIONS, tokenizer=byte_tokenizer(chat_template=True)) as running:
        yield running


def _post(server, route: str, body: dict):
    running, _ = server
    answer = local_http.post(running.url + route, json=body, timeout=60)
    return answer.status_code, answer.json()


def _error(server, route: str, body: dict) -> tuple:
    status, answer = _post(server, route, body)
    assert status == 400, answer
    return answer["error"]["param"], answer["error"]["message"]


def test_null_beam_width_without_use_beam_search_is_served_as_if_not_sent(server):
    body = {"prompt": PROMPT[:4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(server, "/v1/completions", body)
    nulled = _post(server, "/v1/completions", {**body, "beam_width": None})
    assert plain[0] == nulled[0] == 200, nulled
    assert [c["token_ids"] for c in nulled[1]["choices"]] == \
        [c["token_ids"] for c in plain[1]["choices"]]
    assert len(plain[1]["choices"][0]["token_ids"]) == 3


def test_beams_that_cannot_make_their_first_decode_step_are_a_400_naming_the_width(server):
    completion = {**BEAMS, "prompt": PROMPT, "max_tokens": 2}
    chat = {**BEAMS, "messages": MESSAGES, "max_completion_tokens": 2}
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for width in ({"beam_width": 3}, {"beam_width": 3, "n": 2}, {"n": 3}):
            param = "beam_width" if "beam_width" in width else "n"
            assert _error(server, route, {**body, **width}) == \
                (param, FIRST_STEP.format(param=param)), (route, width)
        status, answer = _post(server, route, {**body, "beam_width": 2})   # "the most": it runs
        assert status == 200 and [len(c["token_ids"]) for c in answer["choices"]] == [2]
    # one prompt of several is named by its index, whichever field sets the width
    assert _error(server, "/v1/completions", {**completion, "prompt": [[1, 2, 3], PROMPT],
                                              "n": 3}) == \
        ("n", "prompt 1: " + FIRST_STEP.format(param="n"))
    # 2 beams make their first step but not 9 tokens (57 at most): max_tokens is at fault
    assert _error(server, "/v1/completions", {**completion, "beam_width": 2, "max_tokens": 9}) \
        == ("max_tokens", "this model's context is 57 tokens for a beam search of beam_width 2 "
                          "after a 49-token prompt; the request asks for 58 (49 in the prompt, "
                          "9 max_tokens)")
    # one token needs no decode step: 3 beams of 1 token run
    status, answer = _post(server, "/v1/completions",
                           {**completion, "beam_width": 3, "n": 3, "max_tokens": 1})
    assert status == 200 and [len(c["token_ids"]) for c in answer["choices"]] == [1, 1, 1]
    assert not server[1].has_unfinished()


@pytest.mark.parametrize("width", [5, 1000])
def test_a_beam_width_past_max_batch_is_refused_by_the_request_check_naming_it(server, width):
    running, engine = server
    served = ServedModel.of(engine, "tiny-llama")
    completion = {**BEAMS, "prompt": [1, 2, 3], "max_tokens": 2}
    chat = {**BEAMS, "messages": [{"role": "user", "content": "hi"}]}
    for route, body, check in (
            ("/v1/completions", completion,
             lambda b: prompt_token_ids(parse_completion_request(b), served)),
            ("/v1/chat/completions", chat,
             lambda b: chat_token_ids(parse_chat_request(b), served))):
        for fields, param in (({"beam_width": width}, "beam_width"), ({"n": width}, "n")):
            want = (param, PAST_MAX_BATCH.format(param=param, width=width))
            with pytest.raises(ApiError) as refused:    # the request check, before any queue
                check(json.dumps({**body, **fields}).encode())
            assert (refused.value.status, refused.value.param, refused.value.message) == \
                (400, *want)
            assert _error(server, route, {**body, **fields}) == want, (route, fields)
    assert not engine.has_unfinished()
