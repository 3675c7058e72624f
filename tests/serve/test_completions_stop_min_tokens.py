"""A completion with ``stop`` and ``min_tokens`` over HTTP ends as ``Engine.generate`` does:
no stop string is looked for until the output has more than min_tokens tokens (vLLM's rule;
the server path ended at the first "x" with min_tokens=6 ignored)."""
from __future__ import annotations


from vmemkv.runtime.engine import Engine, SamplingParams

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import NAME, VMEM, model, serving

X = ord("x")


def test_served_stop_string_waits_for_min_tokens_as_the_engine():
    body = dict(model=NAME, prompt=[ord(c) for c in "abc"], max_tokens=10, min_tokens=6,
                stop=["x"], logit_bias={str(X): 100}, ignore_eos=True, temperature=0.0)
    with serving(VMEM, tokenizer=byte_tokenizer()) as (server, _):
        r = local_http.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("x" * 6, "stop")
    assert choice["token_ids"] == [X] * 7
    with Engine(model(), byte_tokenizer(), **VMEM) as engine:
        out = engine.generate([body["prompt"]], SamplingParams(
            max_new_tokens=10, min_tokens=6, stop=["x"], logit_bias={X: 100.0},
            ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [X] * 7 and out.text == choice["text"]
