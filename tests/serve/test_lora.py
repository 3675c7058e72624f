"""LoRA adapters over HTTP (issue 31): the ``model`` field picks an adapter and its tokens are
the engine's with that adapter; /v1/models lists adapters under the base model; runtime loading
is off without --lora-root, confined to that folder, behind the API key, a 409 for a name
taken, a 400 naming the field for every mistake."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import re

import httpx
import pytest
import torch

peft = pytest.importorskip("peft")

from vmemkv.runtime.engine import Engine  # noqa: E402
from vmemkv.runtime.serve import Server  # noqa: E402
from vmemkv.runtime.serve.auth import AuthConfig  # noqa: E402

from vmemkv.runtime.models import build_model  # noqa: E402

from . import local_http
from .conftest import NAME, VMEM  # noqa: E402

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 101, 33, 2, 250, 9]


@functools.lru_cache(maxsize=None)
def model():
    """Its own copy: adapters wrap a model's projections (the shared fixture stays plain)."""
    return build_model(NAME, seed=0)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for name, seed in (("one", 1), ("two", 2)):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False)
        peft.get_peft_model(copy.deepcopy(model()), config).save_pretrained(str(root / name))
    return root


@contextlib.contextmanager
def serving(lora_root=None, auth=None, loras=()):
    with Engine(model(), **VMEM) as engine:
        for name, path in loras:
            engine.add_lora(name, path)
        with Server(engine, NAME, host="127.0.0.1", port=0, auth=auth,
                    lora_root=lora_root).start() as server:
            yield server, engine


def post(server, path: str, body, headers=None) -> httpx.Response:
    return local_http.post(server.url + path, content=json.dumps(body), timeout=60,
                           headers={"Content-Type": "application/json", **(headers or {})})


def tokens_of(response) -> list:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def refused(response, status: int, param) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error["message"]


def test_model_field_picks_the_adapter_and_models_lists_it(adapter_root):
    with serving(loras=[("one", str(adapter_root / "one"))]) as (server, engine):
        listed = local_http.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(NAME, None), ("one", NAME)]
        base = tokens_of(post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT}))
        response = post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "model": "one"})
        assert response.json()["model"] == "one"
        with_one = tokens_of(response)
        chat_refused = post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT,
                                                        "model": "zzz"})
        assert "'zzz' is not served" in refused(chat_refused, 404, "model")
        beam = post(server, "/v1/completions", {"max_tokens": 4, "prompt": PROMPT,
                                                "model": "one", "use_beam_search": True,
                                                "n": 2, "temperature": 0})
        refused(beam, 400, "model")
    with Engine(model(), **VMEM) as engine:
        from vmemkv.runtime.engine import SamplingParams
        engine.add_lora("one", str(adapter_root / "one"))
        expect = engine.generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                          lora="one"))
    assert with_one == expect[0].outputs[0].token_ids and with_one != base


def test_runtime_loading_is_off_without_a_root(adapter_root):
    with serving() as (server, engine):
        body = {"lora_name": "one", "lora_path": str(adapter_root / "one")}
        assert post(server, "/v1/load_lora_adapter", body).status_code == 403
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "one"}).status_code == 403
        assert engine.loras == []


def test_load_use_replace_unload_and_every_mistake(adapter_root, tmp_path):
    auth = AuthConfig.of(["k1"], None, False)
    key = {"Authorization": "Bearer k1"}
    with serving(lora_root=str(adapter_root), auth=auth) as (server, engine):
        load = {"lora_name": "x", "lora_path": "one"}
        assert post(server, "/v1/load_lora_adapter", load).status_code == 401   # no key
        assert post(server, "/v1/load_lora_adapter", load, key).status_code == 200
        assert engine.loras == ["x"]
        first = tokens_of(post(server, "/v1/completions",
                               {**GREEDY, "prompt": PROMPT, "model": "x"}, key))
        refused(post(server, "/v1/load_lora_adapter", load, key), 409, "lora_name")
        message = refused(post(server, "/v1/load_lora_adapter",
                               {"lora_name": "y", "lora_path": "../" + tmp_path.name}, key),
                          400, "lora_path")
        assert "--lora-root" in message
        refused(post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "nope"},
                     key), 400, "lora_path")
        refused(post(server, "/v1/load_lora_adapter", {"lora_name": "y"}, key), 400, "lora_path")
        refused(post(server, "/v1/load_lora_adapter", {**load, "extra": 1}, key), 400, "extra")
        refused(post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "o\x00ne"},
                     key), 400, "lora_path")                  # a NUL byte: was a 500
        (adapter_root / "loop").symlink_to("loop")             # was a 500 (RuntimeError)
        for path, reason in [("a" * 300, "too long"), ("x/" * 2000, ""), ("loop", "loop")]:
            message = refused(post(server, "/v1/load_lora_adapter",      # a name over NAME_MAX
                                   {"lora_name": "y", "lora_path": path}, key), 400, "lora_path")
            assert reason in message                                     # was a 500 (OSError)
        outside = tmp_path / "outside"                        # files linked from inside the
        outside.mkdir()                                       # root, to an adapter outside it
        linked = adapter_root / "linked"
        linked.mkdir(exist_ok=True)
        for f in (adapter_root / "one").iterdir():
            (outside / f.name).write_bytes(f.read_bytes())
            if not (linked / f.name).exists():
                (linked / f.name).symlink_to(outside / f.name)
        refused(post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "linked"},
                     key), 400, "lora_path")                  # was loaded: 200
        refused(post(server, "/v1/load_lora_adapter", {"lora_name": "tiny-llama",
                                                       "lora_path": "one"}, key),
                400, "lora_name")   # the served model's id: its requests got the base model
        assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "two",
                                                      "replace": True}, key).status_code == 200
        second = tokens_of(post(server, "/v1/completions",
                                {**GREEDY, "prompt": PROMPT, "model": "x"}, key))
        assert second != first
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}, key).status_code == 200
        refused(post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}, key), 400,
                "lora_name")
        refused(post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "model": "x"}, key),
                404, "model")
        assert engine.loras == []


def test_an_adapters_limit_counts_the_pages_it_takes(adapter_root):
    # /v1/models listed an adapter with the base model's max_model_len, and a request within
    # it was refused by the engine ('request 2: 449 tokens beside adapter ...', param prompt)
    with Engine(model(), **{**VMEM, "max_context": 256, "cache_bytes": 64 * 1024}) as engine:
        engine.add_lora("one", str(adapter_root / "one"))
        with Server(engine, NAME, host="127.0.0.1", port=0).start() as server:
            listed = {m["id"]: m["max_model_len"]
                      for m in local_http.get(server.url + "/v1/models").json()["data"]}
            assert listed == {NAME: 128, "one": 96}
            body = {**GREEDY, "model": "one", "prompt": [1], "max_tokens": 95}
            answer = post(server, "/v1/completions", body)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 95
            answer = post(server, "/v1/completions", {**body, "max_tokens": 96})
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["param"] == "max_tokens" and not re.search(r"request \d", error["message"])
            assert error["message"].startswith("this model's context is 96 tokens beside "
                                               "adapter 'one'")
