"""A request whose processed scores all overflow to -inf (repetition_penalty 1e38 on a prompt
holding every vocabulary id, logit_bias -100 on every id) is the client's error: over HTTP it
is a 400 that names ``repetition_penalty``, streamed or not, alone or beside another request,
which goes on exactly as without it; nothing is left held. (It was a 500: "internal error in
this request only" beside others, "internal server error" when its step held it alone.)"""
from __future__ import annotations

import json


from vmemkv.runtime.engine import Engine, SamplingParams

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import NAME, VMEM, VOCAB, assert_memory_at_baseline, model, serving, wait_until_idle

OPTIONS = dict(VMEM, max_context=VOCAB + 44)
ALL_INF = dict(model=NAME, prompt=list(range(VOCAB)), max_tokens=3, ignore_eos=True,
               repetition_penalty=1e38, logit_bias={str(t): -100 for t in range(VOCAB)})
NEIGHBOUR = dict(model=NAME, prompt=[5, 6, 7], max_tokens=40, ignore_eos=True, temperature=0.0)


def assert_refused_naming_the_field(error: dict) -> None:
    assert error["type"] == "invalid_request_error" and error["param"] == "repetition_penalty", error
    assert "repetition_penalty" in error["message"] and "-inf" in error["message"], error


def test_all_inf_request_alone_is_a_400_naming_the_field_and_nothing_held():
    with serving(OPTIONS, tokenizer=byte_tokenizer()) as (server, engine):
        for temperature in (0.0, 1.0):
            r = local_http.post(server.url + "/v1/completions", timeout=60,
                                json=dict(ALL_INF, temperature=temperature, seed=1))
            assert r.status_code == 400, r.text
            assert_refused_naming_the_field(r.json()["error"])
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
        after = local_http.post(server.url + "/v1/completions", json=NEIGHBOUR, timeout=60)
        assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 40


def test_all_inf_request_beside_a_stream_fails_alone_streamed_and_not():
    with Engine(model(), byte_tokenizer(), **OPTIONS) as engine:
        expected = engine.generate([NEIGHBOUR["prompt"]], SamplingParams(
            max_new_tokens=40, ignore_eos=True))[0].outputs[0].token_ids
    with serving(OPTIONS, tokenizer=byte_tokenizer()) as (server, engine):
        url = server.url + "/v1/completions"
        with local_http.stream("POST", url, json=dict(NEIGHBOUR, stream=True), timeout=60) as good:
            lines = good.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            refused = local_http.post(url, json=ALL_INF, timeout=60)
            streamed = local_http.post(url, json=dict(ALL_INF, stream=True, temperature=1.0),
                                       timeout=60)
            chunks = [first] + [line for line in lines if line.startswith("data: ")]
        assert refused.status_code == 400, refused.text
        assert_refused_naming_the_field(refused.json()["error"])
        assert streamed.status_code == 200   # the status line went before the failing step
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert_refused_naming_the_field(events[-1]["error"])
        assert chunks[-1] == "data: [DONE]"
        tokens = [t for c in chunks[:-1] for t in json.loads(c[6:])["choices"][0]["token_ids"]]
        assert tokens == list(expected)
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
