"""A windowed model's server limit is the engine's: per prompt, counting what each layer kind
holds (tiny-mistral-swa in 48 KiB: the full-length bound was 96 tokens, the engine runs 256
after a short prompt). The server refused with a 400 what the engine would run. /v1/models'
max_model_len is what ANY prompt may ask for (a longer prompt is allocated whole in every
layer): it said 256 for a while, and a 129-token prompt + 1 was refused well inside it."""
import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server
from . import local_http

KiB = 1024
OPTIONS = dict(cache="vmem", cache_bytes=48 * KiB, page_bytes=4 * KiB, max_context=256,
               max_batch=2, layout="per-layer", self_check=False)


@pytest.fixture(scope="module")
def server():
    with Engine(build_model("tiny-mistral-swa", seed=0), None, **OPTIONS) as engine:
        with Server(engine, "swa", host="127.0.0.1", port=0).start() as running:
            yield running


def test_the_window_aware_limit_is_served_and_reported(server):
    models = local_http.get(server.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 97
    for prompt_tokens in (1, 50, 96):        # any prompt within it runs to it
        body = {"model": "swa", "prompt": list(range(1, prompt_tokens + 1)), "temperature": 0,
                "max_tokens": 97 - prompt_tokens, "ignore_eos": True}
        answer = local_http.post(server.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
    body = {"model": "swa", "prompt": list(range(1, 21)), "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    answer = local_http.post(server.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 200


def test_past_the_window_aware_limit_is_a_400_naming_max_tokens(server):
    body = {"model": "swa", "prompt": list(range(1, 21)), "max_tokens": 240, "temperature": 0}
    answer = local_http.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_tokens" and "256 tokens after a 20-token prompt" in error["message"]


def test_a_prompt_past_its_own_limit_is_a_400_naming_the_prompt(server):
    body = {"model": "swa", "prompt": list(range(1, 131)), "max_tokens": 1, "temperature": 0}
    answer = local_http.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].endswith("after a 130-token prompt; the prompt alone holds 130 tokens")
