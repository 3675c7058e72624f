"""Each API key's share of the response budget (``--max-response-memory-bytes``): one key within
its ``--max-requests-per-key`` could reserve the whole budget (two requests of a 4-request cap
held 128,056 of 131,072 bytes), and every other key's request was a 503 until that key's clients
had read their answers. Now a key may hold the share its requests have of the queue (at least
one response at ``--max-response-bytes``); past it, 429 naming the key's own figures, nothing
reserved, the budget and the other keys unchanged."""
from __future__ import annotations

import threading

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.serve import Server
from vmemkv.runtime.serve.auth import AuthConfig
from vmemkv.runtime.serve.errors import ApiError, KeyBudgetError
from vmemkv.runtime.serve.in_flight import RequestsInFlight
from vmemkv.runtime.serve.limits import ServeLimits
from vmemkv.runtime.serve.submission import ResponseBudget

from . import local_http
from .conftest import NAME, VMEM, assert_memory_at_baseline, model, wait_until_idle
from .test_requests_per_key import wait_for


def test_a_keys_budget_share_is_its_queue_share_and_never_under_one_response():
    assert RequestsInFlight(8, 4).key_share_bytes(1000, 100) == 500
    assert RequestsInFlight(256, 8).key_share_bytes(4 * 64, 64) == 64     # floor: one response
    assert RequestsInFlight(8, None).key_share_bytes(1000, 100) is None  # no cap: no share


def test_a_key_past_its_budget_share_is_429_naming_its_own_figures_and_nothing_is_reserved():
    budget = ResponseBudget(1000)
    a_first = budget.reserve(400, "a", 500)
    with pytest.raises(KeyBudgetError) as refused:
        budget.reserve(200, "a", 500)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    assert refused.value.body()["error"]["type"] == "rate_limit_exceeded"
    assert refused.value.message.startswith(
        "this API key's responses (being made or not yet read) hold 400 bytes and this one "
        "could take 200, past its share of 500 bytes of the server's response budget")
    assert (budget.held_bytes, budget.held_by("a"), budget.held_by("b")) == (400, 400, 0)
    b_first = budget.reserve(500, "b", 500)               # b's share is whole: a held nothing of it
    unkeyed = budget.reserve(100)                         # no key: the budget alone counts it
    with pytest.raises(ApiError) as full:                 # the shared budget is still one
        budget.reserve(1, "c", 500)
    assert full.value.status == 503 and "--max-response-memory-bytes" in full.value.message
    assert (budget.held_bytes, budget.held_by("c")) == (1000, 0)
    a_first.release()
    a_first.release()                                     # once only
    assert (budget.held_bytes, budget.held_by("a"), budget.held_by("b")) == (600, 0, 500)
    budget.reserve(200, "a", 500)                         # room again for a
    b_first.release()
    unkeyed.release()
    assert (budget.held_bytes, budget.held_by("a"), budget.held_by("b")) == (200, 200, 0)


def test_a_real_server_keeps_one_key_from_holding_the_whole_response_budget(monkeypatch):
    """Key a's two large requests (64,028 bytes each, logprobs 20) fit its requests cap of 4 of
    8 but not its half of the 131,072-byte budget: the second is 429; key b's request is
    served, where before it was a 503 naming the budget."""
    gate, answers = threading.Event(), []
    large = {"prompt": [1, 2, 3], "max_tokens": 36, "logprobs": 20, "temperature": 0}
    small = {"prompt": [1, 2, 3], "max_tokens": 20, "logprobs": 1, "temperature": 0}
    limits = ServeLimits(max_response_bytes=64 * 1024)
    with Engine(model(), None, **VMEM) as engine:
        with Server(engine, NAME, port=0, max_queue=8, auth=AuthConfig(("key-a", "key-b")),
                    max_requests_per_key=4, limits=limits,
                    max_response_memory_bytes=2 * 64 * 1024).start() as server:
            step, budget = engine.step, server.engine_thread.response_budget
            monkeypatch.setattr(engine, "step", lambda: gate.wait(30) and step())   # hold it

            def post(body, key: str):
                return local_http.post(server.url + "/v1/completions", json=body, timeout=60,
                                       headers={"Authorization": f"Bearer {key}"})
            workers = [threading.Thread(target=lambda k=k, b=b: answers.append((k, post(b, k))))
                       for k, b in (("key-a", large), ("key-b", small))]
            try:
                workers[0].start()
                wait_for(lambda: server.engine_thread.in_flight.of_key("key-a") == 1)
                assert budget.held_bytes == 64028              # a's one request's estimate
                refused = post(large, "key-a")
                assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["message"].startswith(
                    "this API key's responses (being made or not yet read) hold 64,028 bytes "
                    "and this one could take 64,028, past its share of 65,536 bytes")
                assert budget.held_bytes == budget.held_by("key-a") == 64028   # nothing taken
                assert server.engine_thread.in_flight.of_key("key-a") == 1
                workers[1].start()                          # b: room in the budget
                wait_for(lambda: server.engine_thread.in_flight.of_key("key-b") == 1)
            finally:
                gate.set()
            for worker in workers:
                worker.join(60)
            wait_until_idle(server)
            assert sorted((k, a.status_code) for k, a in answers) == [("key-a", 200),
                                                                      ("key-b", 200)]
            wait_for(lambda: budget.held_bytes == 0)
            assert budget.held_by("key-a") == budget.held_by("key-b") == 0
        assert_memory_at_baseline(engine)
