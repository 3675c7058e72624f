"""Stop strings with ``min_tokens`` over HTTP, streamed and not: completions and chat, n=2,
``include_stop_str_in_output`` either way, stop strings spanning tokens (ASCII pairs and the
two bytes of "é"): the streamed deltas joined equal the non-streamed text and the engine's, and
the finish reasons agree (no stop string counts until the sample has more than min_tokens
tokens, as in vLLM)."""
from __future__ import annotations

import json


from vmemkv.runtime.engine import Engine, SamplingParams

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import NAME, VMEM, model, serving

MESSAGES = [{"role": "user", "content": "hi"}]
XY, E_ACUTE_Y = (ord("x"), ord("y")), (0xC3, 0xA9, ord("y"))
CASES = [(["xy"], XY, 3, False), (["xy"], XY, 1, True), (["é", "yé"], E_ACUTE_Y, 2, False),
         (["é", "yé"], E_ACUTE_Y, 2, True), (["yx", "xyx"], XY, 5, True),
         (["zz"], XY, 2, False)]   # (stop, the ids biased +100, min_tokens, include)


def streamed(response, chat: bool) -> tuple:
    """({choice index: its deltas joined}, {choice index: its finish_reason})."""
    texts, reasons = {0: "", 1: ""}, {}
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = (choice["delta"].get("content") if chat else choice["text"]) or ""
            texts[choice["index"]] += delta
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    return texts, reasons


def test_streamed_stop_strings_with_min_tokens_equal_whole_answers_and_the_engine():
    tokenizer = byte_tokenizer(chat_template=True)
    finish_reasons = set()
    with Engine(model(), tokenizer, **VMEM) as engine, \
            serving(VMEM, tokenizer=tokenizer) as (server, _):
        for stop, biased, min_tokens, include in CASES:
            params = dict(min_tokens=min_tokens, stop=stop, include_stop_str_in_output=include,
                          ignore_eos=True, temperature=1.0, seed=2, n=2)
            bias = {token: 100.0 for token in biased}
            sampling = SamplingParams(max_new_tokens=12, logit_bias=bias, **params)
            wire = dict(params, model=NAME, logit_bias={str(t): b for t, b in bias.items()})
            for chat in (False, True):
                if chat:
                    want = engine.chat([MESSAGES], sampling)[0].outputs
                    url, body = "/v1/chat/completions", dict(wire, messages=MESSAGES,
                                                             max_completion_tokens=12)
                else:
                    want = engine.generate(["ab"], sampling)[0].outputs
                    url, body = "/v1/completions", dict(wire, prompt="ab", max_tokens=12)
                whole = local_http.post(server.url + url, json=body, timeout=60)
                stream = local_http.post(server.url + url, json=dict(body, stream=True), timeout=60)
                assert whole.status_code == stream.status_code == 200, whole.text
                texts, reasons = streamed(stream, chat)
                for i, out in enumerate(want):
                    choice = whole.json()["choices"][i]
                    text = choice["message"]["content"] if chat else choice["text"]
                    assert text == texts[i] == out.text, (stop, min_tokens, include, chat, i)
                    assert choice["finish_reason"] == reasons[i] == out.finish_reason
                    assert len(out.token_ids) > min_tokens
                    finish_reasons.add(out.finish_reason)
                    if include and out.finish_reason == "stop":
                        assert any(text.endswith(s) for s in stop)
    assert finish_reasons == {"stop", "length"}   # both ends were exercised
