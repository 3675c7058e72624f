"""A windowed model's server limit is the engine's: per prompt, counting what each layer kind
holds (tiny-mistral-swa in 48 KiB: the full-length bound was 96 tokens, the engine runs 256).
The server refused with a 400 what the engine would run, and /v1/models said 96."""
import httpx
import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server

KiB = 1024
OPTIONS = dict(cache="vmem", cache_bytes=48 * KiB, page_bytes=4 * KiB, max_context=256,
               max_batch=2, layout="per-layer", self_check=False)


@pytest.fixture(scope="module")
def server():
    with Engine(build_model("tiny-mistral-swa", seed=0), None, **OPTIONS) as engine:
        with Server(engine, "swa", host="127.0.0.1", port=0).start() as running:
            yield running


def test_the_window_aware_limit_is_served_and_reported(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 256
    body = {"model": "swa", "prompt": list(range(1, 21)), "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 200


def test_past_the_window_aware_limit_is_a_400_naming_max_tokens(server):
    body = {"model": "swa", "prompt": list(range(1, 21)), "max_tokens": 240, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_tokens" and "256 tokens" in error["message"]
