"""OpenAI compatibility: JSON null is the default of every field OpenAI types "X or null";
``created`` is one timestamp per request, in every chunk of a stream; ``seed`` is an int64 (a
400 naming it outside) and distinct seeds draw distinct tokens; ``GET /v1/models/{model}`` (the
client's ``models.retrieve``) answers the list's object, a 404 naming an id not served."""
from __future__ import annotations

import copy
import itertools
import json
import threading
import time

import pytest
import torch

from vmemkv.runtime.engine import sampler
from vmemkv.runtime.serve.auth import AuthConfig
from vmemkv.runtime.serve.chat import parse_chat_request
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.protocol import parse_completion_request

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import NAME, VMEM, serving

COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4, "seed": 7, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "seed": 7,
        "ignore_eos": True}
CPU = torch.device("cpu")
# the fields OpenAI's API reference types "X or null" (its default when null), per API
SHARED_NULLABLE = ("temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
                   "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", "logprobs")
COMPLETION_NULLABLE = SHARED_NULLABLE + ("echo", "best_of")
CHAT_NULLABLE = SHARED_NULLABLE + ("max_completion_tokens", "top_logprobs")


def _parsed(parse, body: dict):
    request = parse(json.dumps(body).encode())
    return request.model_dump(), request.model_fields_set


@pytest.mark.parametrize("parse, base, fields", [
    (parse_completion_request, COMPLETION, COMPLETION_NULLABLE),
    (parse_chat_request, CHAT, CHAT_NULLABLE)], ids=["completions", "chat"])
def test_null_in_a_nullable_field_is_the_field_left_out(parse, base, fields):
    for field in fields:
        without = {k: v for k, v in base.items() if k != field}
        assert _parsed(parse, {**without, field: None}) == _parsed(parse, without), field


@pytest.mark.parametrize("parse, base", [(parse_completion_request, COMPLETION),
                                         (parse_chat_request, CHAT)], ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", [
    ("temperature", "1"), ("n", 1.5), ("stream", 1), ("logprobs", "yes"),
    ("ignore_eos", None), ("top_k", None), ("stop_token_ids", None), ("min_tokens", None)])
def test_a_wrong_type_or_null_in_a_field_that_is_not_nullable_is_a_400_naming_it(
        parse, base, field, value):
    with pytest.raises(ApiError) as caught:
        parse(json.dumps({**base, field: value}).encode())
    assert (caught.value.status, caught.value.param) == (400, field)


def test_null_fields_over_http_answer_what_the_defaults_answer():
    nulls = {f: None for f in ("temperature", "top_p", "n", "presence_penalty",
                               "frequency_penalty", "stream", "echo", "logprobs", "best_of",
                               "stop", "user", "logit_bias", "stream_options")}
    chat_nulls = {f: None for f in ("temperature", "top_p", "n", "stream", "logprobs",
                                    "top_logprobs", "max_tokens", "presence_penalty")}
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, _):
        for path, body, null in (("/v1/completions", COMPLETION, nulls),
                                 ("/v1/chat/completions", CHAT, chat_nulls)):
            plain = local_http.post(server.url + path, json=body, timeout=60)
            nulled = local_http.post(server.url + path, json={**body, **null}, timeout=60)
            assert plain.status_code == nulled.status_code == 200, nulled.text
            assert [c["token_ids"] for c in nulled.json()["choices"]] == \
                [c["token_ids"] for c in plain.json()["choices"]]
            assert len(plain.json()["choices"][0]["token_ids"]) == 4
        # completions' max_tokens: null is its default, 16
        done = local_http.post(server.url + "/v1/completions",
                               json={**COMPLETION, "max_tokens": None}, timeout=60).json()
        assert done["usage"]["completion_tokens"] == 16


def test_created_is_stamped_once_per_request_streamed_or_not(monkeypatch):
    """A clock that moves one second per reading: every envelope of a request still carries
    the one ``created`` (the old code read the clock per chunk: 7 values for 6 tokens)."""
    ticks, lock, real = itertools.count(1_800_000_000), threading.Lock(), time.time

    def clock() -> float:
        with lock:
            return float(next(ticks))
    with serving(VMEM) as (server, _):
        monkeypatch.setattr(time, "time", clock)
        try:
            body = {**COMPLETION, "max_tokens": 6, "stream": True,
                    "stream_options": {"include_usage": True}}
            with local_http.stream("POST", server.url + "/v1/completions", json=body,
                                   timeout=60) as r:
                chunks = [json.loads(line[5:]) for line in r.iter_lines()
                          if line.startswith("data:") and line != "data: [DONE]"]
            done = local_http.post(server.url + "/v1/completions", json=COMPLETION, timeout=60).json()
        finally:
            monkeypatch.setattr(time, "time", real)
    assert len(chunks) == 7 and chunks[-1]["usage"]["completion_tokens"] == 6
    assert len({c["created"] for c in chunks}) == 1
    assert chunks[0]["created"] >= 1_800_000_000 and done["created"] > chunks[0]["created"]


def test_a_seed_outside_int64_is_a_400_naming_seed_and_the_edges_are_taken():
    with serving(VMEM) as (server, _):
        for seed in (2**63 - 1, -2**63):
            r = local_http.post(server.url + "/v1/completions", json={**COMPLETION, "seed": seed},
                                timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        for seed in (2**63, -2**63 - 1, 2**200):
            r = local_http.post(server.url + "/v1/completions", json={**COMPLETION, "seed": seed},
                                timeout=60)
            assert (r.status_code, r.json()["error"]["param"]) == (400, "seed"), r.text
            assert "9223372036854775" in r.json()["error"]["message"]
        # a value cut to fit the message is marked, never shown as another number
        assert r.json()["error"]["message"].endswith(str(2**200)[:57] + "...")


def test_distinct_int64_seeds_draw_distinct_tokens_and_a_seed_is_deterministic():
    # the old mix, (seed * 1_000_003 + i) % 2**63, gave each pair one generator seed
    for a, b in ((-1, 2**63 - 1), (0, -2**63), (1, 1 - 2**63)):
        assert sampler.make_generator(a, 0, CPU).initial_seed() != \
            sampler.make_generator(b, 0, CPU).initial_seed()
    # SplitMix64's published vector: seed 1234567 gives 6457827717110365317, 3203168211198807973
    assert [sampler.make_generator(1234567, i, CPU).initial_seed() for i in (0, 1)] == [
        6457827717110365317, 3203168211198807973]
    draw = lambda seed, i: torch.randint(2**30, (4,),
                                         generator=sampler.make_generator(seed, i, CPU))
    assert torch.equal(draw(5, 0), draw(5, 0)) and not torch.equal(draw(5, 0), draw(5, 1))
    with serving(VMEM) as (server, _):
        def tokens(seed: int) -> list:
            body = {**COMPLETION, "max_tokens": 8, "temperature": 1.0, "seed": seed}
            r = local_http.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        assert tokens(-1) != tokens(2**63 - 1) and tokens(0) != tokens(-2**63)
        assert tokens(-2**63) == tokens(-2**63)


def test_models_retrieve_answers_the_listed_object_and_a_404_naming_an_unknown_id(tmp_path):
    peft = pytest.importorskip("peft")
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.models import build_model
    from vmemkv.runtime.serve import Server
    import openai
    base = build_model(NAME, seed=0)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(str(tmp_path / "one"))
    with Engine(base, **VMEM) as engine:
        engine.add_lora("org/one", str(tmp_path / "one"))
        with Server(engine, NAME, host="127.0.0.1", port=0,
                    auth=AuthConfig(("k1",))).start() as server:
            key = {"Authorization": "Bearer k1"}
            listed = local_http.get(server.url + "/v1/models", headers=key).json()["data"]
            assert [m["id"] for m in listed] == [NAME, "org/one"]
            for entry in listed:
                got = local_http.get(f"{server.url}/v1/models/{entry['id']}", headers=key)
                assert (got.status_code, got.json()) == (200, entry)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="k1", max_retries=0)
            assert client.models.retrieve(NAME).max_model_len == listed[0]["max_model_len"]
            missing = local_http.get(server.url + "/v1/models/gpt-4", headers=key)
            assert missing.status_code == 404
            assert missing.json()["error"]["param"] == "model"
            assert missing.json()["error"]["type"] == "not_found_error"
            assert "'gpt-4'" in missing.json()["error"]["message"]
            assert local_http.get(f"{server.url}/v1/models/{NAME}").status_code == 401
