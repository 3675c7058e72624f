"""Text through the server: text prompts with a tokenizer give Engine.generate's text; a stop
string ends a choice with finish_reason "stop", is not in the text, and the request's memory
comes back; multi-byte characters round-trip, streamed and not (the incremental text itself is
tested against a shadow in tests/engine/test_text_output.py)."""
from __future__ import annotations

import json

from vmemkv.runtime.engine import Engine, SamplingParams
from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from ..engine.test_text_prompts import TEXTS, make_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, model, serving, wait_until_idle

BODY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def reference_texts(tokenizer) -> list[str]:
    with Engine(model(), tokenizer, **VMEM) as engine:
        outs = engine.generate(TEXTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def streamed_text(url: str, body: dict) -> tuple[str, str]:
    with local_http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_text_prompts_give_the_engines_text_and_stop_strings_cut_it():
    tokenizer = make_tokenizer()
    want = reference_texts(tokenizer)
    with serving(VMEM, tokenizer=tokenizer) as (server, engine):
        for prompt, text in zip(TEXTS, want):
            got = local_http.post(server.url + "/v1/completions", json={**BODY, "prompt": prompt}).json()
            assert got["choices"][0]["text"] == text
            assert streamed_text(server.url, {**BODY, "prompt": prompt}) == (text, "length")
            stop = text.split()[2]            # a word the greedy output reaches
            cut = text[:text.index(stop)]
            body = {**BODY, "prompt": prompt, "stop": [stop]}
            got = local_http.post(server.url + "/v1/completions", json=body).json()["choices"][0]
            assert (got["text"], got["finish_reason"]) == (cut, "stop")
            assert streamed_text(server.url, body) == (cut, "stop")
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_multibyte_text_round_trips_streamed_and_not():
    """Issue 26's second failure: main's server sent a delta ending in U+FFFD and then skipped
    the completed character. Random weights over a byte vocabulary emit multi-byte and broken
    UTF-8 alike: the streamed deltas, the JSON text and decode(token_ids) agree exactly."""
    tok = byte_tokenizer()
    body = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    with serving(VMEM, tokenizer=tok) as (server, engine):
        for seed in range(4):
            request = {**body, "prompt": "日本の首都は", "seed": seed}
            done = local_http.post(server.url + "/v1/completions", json=request).json()["choices"][0]
            assert done["text"] == tok.decode(done["token_ids"])
            assert streamed_text(server.url, request) == (done["text"], "length")
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
