"""A request past the context is a 400 naming the field that must change, for chat
(``messages``), beam search (the engine's limit for its width: ``max_tokens``) and
one prompt of several (named by its index); a refusal the engine makes names the prompt's
index in the request and no internal request id."""
from __future__ import annotations

import re


from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, serving

KiB = 1024
GEMMA3 = dict(cache="vmem", cache_bytes=128 * KiB, page_bytes=4 * KiB, max_context=256,
              max_batch=4, layout="per-layer", self_check=False)


def error_of(answer) -> dict:
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


def test_a_conversation_past_the_context_names_messages():
    # the chat API has no prompt field: it was named, with "1 max_tokens" the server's default
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, _):
        body = {"messages": [{"role": "user", "content": "x" * 80}]}
        error = error_of(local_http.post(server.url + "/v1/chat/completions", json=body))
        assert error["param"] == "messages"
        assert error["message"].startswith("this model's context is 64 tokens; the prompt alone "
                                           "holds")


def test_a_beam_search_is_checked_at_its_whole_length_and_names_max_tokens():
    # beams are held at full length in every layer (64 tokens here, 192 for one sampled
    # sequence after a 20-token prompt): the server let 150 new tokens through and the
    # engine's refusal named beam_width, for one beam too
    with Engine(build_model("tiny-gemma3", seed=0), None, **GEMMA3) as engine:
        with Server(engine, "g3", host="127.0.0.1", port=0).start() as server:
            url = server.url + "/v1/completions"
            for width in (1, 2):
                body = {"prompt": list(range(1, 21)), "max_tokens": 150, "use_beam_search": True,
                        "beam_width": width, "n": 1}
                error = error_of(local_http.post(url, json=body, timeout=60))
                assert error["param"] == "max_tokens" and "context is 64 tokens" in error["message"]
            body = {"prompt": [[1, 2, 3, 4], list(range(1, 62))], "max_tokens": 5,
                    "use_beam_search": True, "n": 1}
            error = error_of(local_http.post(url, json=body, timeout=60))
            assert error["message"].startswith("prompt 1: this model's context is 64 tokens")
            body = {"prompt": list(range(1, 21)), "max_tokens": 44, "use_beam_search": True,
                    "n": 1, "ignore_eos": True}
            answer = local_http.post(url, json=body, timeout=120)
            assert answer.status_code == 200 and answer.json()["usage"]["total_tokens"] == 64


def test_the_engines_refusal_names_the_prompts_index_and_no_request_id():
    with Engine(build_model("tiny-gemma3", seed=0), None, **GEMMA3) as engine:
        engine.add_request([1, 2, 3])
        for add, params, field in ((engine.add_request, None, "max_new_tokens"),
                                   (engine.add_beam_request, BeamSearchParams(2, max_new_tokens=150),
                                    "max_new_tokens")):
            try:
                add(list(range(1, 21)), params or _sampling(300), index=3)
            except RequestRejectedError as error:
                assert str(error).startswith("prompt 3 rejected: 20 prompt + ")
                assert not re.search(r"request \d", str(error)) and error.field == field
            else:
                raise AssertionError("not refused")


def _sampling(max_new_tokens: int):
    from vmemkv.runtime.engine import SamplingParams
    return SamplingParams(max_new_tokens=max_new_tokens)


def test_the_servers_engine_refusal_names_the_prompt_of_several():
    # every prompt of a request reached the engine as its prompt 0. The engine refused this
    # search's group (2 beams over 39 tokens) naming beam_width; the server now holds a beam
    # search to the engine's limit for its width (tests/serve/test_beam_fit_limit.py), so it
    # refuses it first, naming the prompt and beam_width: these 2 beams cannot make their first
    # decode step after 39 tokens, whatever max_tokens, and one beam could
    with serving({**VMEM, "cache_bytes": 32 * KiB}) as (server, _):
        body = {"prompt": [[1, 2, 3], list(range(1, 40))], "max_tokens": 8, "n": 1,
                "use_beam_search": True, "beam_width": 2}
        error = error_of(local_http.post(server.url + "/v1/completions", json=body, timeout=60))
        assert error["param"] == "beam_width"
        assert error["message"] == ("prompt 1: the server's KV cache cannot hold a beam search of 2 "
                                    "beams (beam_width) over a 39-token prompt at its first decode "
                                    "step, where each beam holds its own copy of its newest token's "
                                    "cache unit; the most beams that can decode after this prompt: 1")
