"""vLLM's elastic-memory routes (issue 32): /sleep gives the KV cache's memory back and new
requests get 503 + Retry-After until /wake_up, after which the tokens are those before; a
request in flight at the sleep waits and completes with the tokens it would have had; /resize
grows and shrinks to the bytes it reports, refuses (409, nothing changed) what running requests
hold; every body mistake is a 400 naming the field; with API keys every route needs one."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from vmemkv.runtime.serve.auth import AuthConfig

from . import local_http
from .conftest import KiB, PAGED, VMEM, assert_memory_at_baseline, serving, wait_until_idle

PAGE = 4 * KiB
CACHE = 64 * PAGE
ELASTIC = dict(VMEM, cache_bytes=CACHE, max_cache_bytes=2 * CACHE, self_check=False)
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 101, 33, 2, 250, 9]


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    content = b"" if body is None else body if isinstance(body, (str, bytes)) else json.dumps(body)
    return local_http.post(server.url + path, content=content, timeout=60,
                           headers={"Content-Type": "application/json", **kwargs.pop("headers", {})},
                           **kwargs)


def complete(server, prompt=PROMPT, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {**GREEDY, **fields, "prompt": prompt})


def tokens_of(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def gauges(server) -> dict:
    return metric_values(local_http.get(server.url + "/metrics", timeout=30).text)


def metric_values(text: str) -> dict:
    return {m[1]: float(m[2]) for m in re.finditer(r'^vmemkv:(\w+)\{[^}]*\} (\S+)$', text, re.M)}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def is_sleeping(server) -> bool:
    return local_http.get(server.url + "/is_sleeping", timeout=30).json()["is_sleeping"]


class HeldStep:
    """The engine's steps, counted; each step numbered in ``hold_at`` waits, once it has
    begun (``wait(n)``), for ``release(n)``."""

    def __init__(self, monkeypatch, engine, *hold_at: int) -> None:
        self.calls, self._step = 0, engine.step
        self._holds = {n: (threading.Event(), threading.Event()) for n in hold_at}
        monkeypatch.setattr(engine, "step", self)

    def __call__(self):
        self.calls += 1
        if self.calls in self._holds:
            reached, gate = self._holds[self.calls]
            reached.set()
            assert gate.wait(30)
        return self._step()

    def wait(self, n: int) -> None:
        assert self._holds[n][0].wait(30)

    def release(self, n: int) -> None:
        self._holds[n][1].set()


def wait_for(condition) -> None:
    """Wait until ``condition()`` holds (the bound: a deadlock guard, no timing check)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def command_while_held(server, work) -> tuple[threading.Thread, dict]:
    """``work`` (an admin call) on a thread, returned once its command waits for the engine
    thread, which a HeldStep holds (so nothing else is appended or drained meanwhile)."""
    before = server.engine_thread.queued_commands
    thread, out = in_thread(work)
    wait_for(lambda: server.engine_thread.queued_commands > before)
    return thread, out


def in_thread(work) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=work()))
    thread.start()
    return thread, out


def test_asleep_new_requests_get_503_retry_after_and_after_wake_up_the_tokens_are_the_same():
    with serving(ELASTIC) as (server, engine):
        before = tokens_of(complete(server))
        assert gauges(server)["kv_cache_bytes"] == CACHE and gauges(server)["is_sleeping"] == 0
        slept = post(server, "/sleep", {"level": 1})
        assert slept.status_code == 200 and slept.json() == {"is_sleeping": True,
                                                            "released_bytes": CACHE}
        assert is_sleeping(server) is True and engine.cache_bytes == 0
        assert gauges(server)["kv_cache_bytes"] == 0 and gauges(server)["is_sleeping"] == 1
        refused = complete(server)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        message = error_of(refused)["message"]
        assert "asleep" in message and "/wake_up" in message
        assert server.engine_thread.pending_requests == 0        # refused before queueing
        assert post(server, "/sleep").json()["released_bytes"] == 0   # idempotent, no body
        woke = post(server, "/wake_up")
        assert woke.status_code == 200 and woke.json() == {"is_sleeping": False,
                                                          "cache_bytes": CACHE}
        assert is_sleeping(server) is False and gauges(server)["is_sleeping"] == 0
        assert tokens_of(complete(server)) == before
        assert gauges(server)["kv_cache_bytes"] == CACHE
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_requests_in_flight_at_the_sleep_wait_and_complete_after_wake_up_unchanged(monkeypatch):
    prompts = [PROMPT, [7, 7, 3, 200, 45]]
    with serving(ELASTIC) as (server, engine):
        want = [tokens_of(complete(server, p, max_tokens=20)) for p in prompts]
        held = HeldStep(monkeypatch, engine, 3)
        flights = [in_thread(lambda p=p: complete(server, p, max_tokens=20)) for p in prompts]
        held.wait(3)                                # mid-generation
        wait_for(lambda: server.engine_thread.pending_requests == 2)   # both accepted
        sleeper, slept = command_while_held(server, lambda: post(server, "/sleep"))
        held.release(3)                             # the step ends, then the sleep runs
        sleeper.join(30)
        assert slept["r"].status_code == 200 and slept["r"].json()["released_bytes"] == CACHE
        steps = held.calls
        time.sleep(0.2)                             # asleep: nothing runs, nothing ends
        assert held.calls == steps and all(t.is_alive() for t, _ in flights)
        assert server.engine_thread.pending_requests == 2 and engine.cache_bytes == 0
        assert gauges(server)["num_requests_waiting"] + gauges(server).get(
            "num_requests_swapped", 0) == 2
        assert post(server, "/wake_up").status_code == 200
        for thread, _ in flights:
            thread.join(60)
        assert [tokens_of(out["r"]) for _, out in flights] == want
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_resize_shrinks_and_grows_to_the_bytes_it_reports_and_refuses_past_the_max():
    with serving(ELASTIC) as (server, engine):
        before = tokens_of(complete(server))
        odd = CACHE // 2 + PAGE // 2                 # rounded down to whole pages
        shrunk = post(server, "/resize", {"cache_bytes": odd, "preempt": False})
        assert shrunk.status_code == 200 and shrunk.json() == {"cache_bytes": CACHE // 2}
        assert engine.cache_bytes == CACHE // 2 and gauges(server)["kv_cache_bytes"] == CACHE // 2
        assert tokens_of(complete(server)) == before
        grown = post(server, "/resize", {"cache_bytes": 2 * CACHE})
        assert grown.status_code == 200 and grown.json() == {"cache_bytes": 2 * CACHE}
        assert engine.cache_bytes == 2 * CACHE and gauges(server)["kv_cache_bytes"] == 2 * CACHE
        assert tokens_of(complete(server)) == before
        for body, param in (({"cache_bytes": 3 * CACHE}, "cache_bytes"),
                            ({"memory_utilization": 0.5}, "memory_utilization")):  # host: GBs
            refused = post(server, "/resize", body)
            assert refused.status_code == 409, refused.text
            error = error_of(refused)
            assert error["type"] == "conflict_error" and error["param"] == param
            assert f"max_cache_bytes={2 * CACHE}" in error["message"]
            assert engine.cache_bytes == 2 * CACHE
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


@pytest.mark.parametrize("call", ["resize", "sleep", "wake_up"])
def test_an_admin_answer_comes_after_the_gauges_that_show_it(call):
    """A client with its /resize, /sleep or /wake_up answer that reads /metrics sees the change,
    as one with a finished request sees it gone: the call's future completes (its done-callback
    runs on the engine thread) only once the gauges are refreshed."""
    with serving(ELASTIC) as (server, engine):
        thread = server.engine_thread
        if call == "wake_up":
            thread.sleep().result(60)
        release = threading.Event()     # the engine thread waits on it: the callback is
        thread.call(lambda _: release.wait(60))     # added before the call can complete
        future = {"resize": lambda: thread.call(lambda e: e.resize_cache(CACHE // 2)),
                  "sleep": thread.sleep, "wake_up": thread.wake_up}[call]()
        seen = []
        future.add_done_callback(lambda _: seen.append(metric_values(server.metrics.render())))
        release.set()
        future.result(60)
        want = {"resize": (CACHE // 2, 0), "sleep": (0, 1), "wake_up": (CACHE, 0)}[call]
        assert (seen[0]["kv_cache_bytes"], seen[0]["is_sleeping"]) == want


@pytest.mark.parametrize("grow", ["resize", "wake_up"])
def test_a_shrink_after_a_grow_or_a_wake_up_gives_the_pages_back(grow):
    with serving(ELASTIC) as (server, engine):
        if grow == "resize":
            assert post(server, "/resize", {"cache_bytes": 2 * CACHE}).status_code == 200
        else:
            assert post(server, "/sleep").status_code == 200
            assert post(server, "/wake_up").json()["cache_bytes"] == CACHE
        shrunk = post(server, "/resize", {"cache_bytes": CACHE // 2})
        assert shrunk.status_code == 200, shrunk.text
        assert shrunk.json() == {"cache_bytes": CACHE // 2} and engine.cache_bytes == CACHE // 2


def test_a_shrink_below_what_running_requests_hold_is_409_and_changes_nothing(monkeypatch):
    with serving(ELASTIC) as (server, engine):
        want = tokens_of(complete(server, max_tokens=30))
        held = HeldStep(monkeypatch, engine, 4)
        flight, out = in_thread(lambda: complete(server, max_tokens=30))
        held.wait(4)
        wait_for(lambda: server.engine_thread.pending_requests == 1)
        resizer, resized = command_while_held(
            server, lambda: post(server, "/resize", {"cache_bytes": PAGE}))
        held.release(4)
        resizer.join(30)
        assert resized["r"].status_code == 409, resized["r"].text
        error = error_of(resized["r"])
        assert error["type"] == "conflict_error" and error["param"] == "cache_bytes"
        assert re.search(r"\d+ bytes are held by 1 running sequence", error["message"])
        assert '"preempt": true' in error["message"]
        assert engine.cache_bytes == CACHE and gauges(server)["kv_cache_bytes"] == CACHE
        flight.join(60)
        assert tokens_of(out["r"]) == want            # the running request never noticed
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def test_with_preempt_a_shrink_preempts_and_every_request_completes_unchanged(monkeypatch):
    prompts = [PROMPT, [7, 7, 3, 200, 45]]
    with serving(ELASTIC) as (server, engine):
        want = [tokens_of(complete(server, p, max_tokens=20)) for p in prompts]
        held = HeldStep(monkeypatch, engine, 1, 15)
        flights = [in_thread(lambda p=p: complete(server, p, max_tokens=20)) for p in prompts]
        held.wait(1)
        wait_for(lambda: server.engine_thread.pending_requests == 2)
        held.release(1)                             # both run from step 2 on
        held.wait(15)                               # about 40 tokens held, 4 pages hold 32
        resizer, resized = command_while_held(server, lambda: post(
            server, "/resize", {"cache_bytes": 6 * PAGE, "preempt": True}))
        held.release(15)
        resizer.join(30)
        assert resized["r"].status_code == 200, resized["r"].text
        got = resized["r"].json()["cache_bytes"]    # whole slices of the pool's pages
        assert 0 < got <= 6 * PAGE and got % PAGE == 0 and engine.cache_bytes == got
        for thread, _ in flights:
            thread.join(60)
        assert [tokens_of(out["r"]) for _, out in flights] == want
        assert gauges(server)["num_preemptions_total"] >= 1
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


# (route, body as sent, the field the 400 names, words in the message)
BAD_BODIES = [
    ("/resize", {}, "cache_bytes", "is required"),
    ("/resize", {"preempt": True}, "cache_bytes", "is required"),
    ("/resize", {"cache_bytes": CACHE, "memory_utilization": 0.5}, "memory_utilization",
     "not both"),
    ("/resize", {"cache_bytes": "4096"}, "cache_bytes", "valid integer"),
    ("/resize", {"cache_bytes": 4096.0}, "cache_bytes", "valid integer"),
    ("/resize", {"cache_bytes": True}, "cache_bytes", "valid integer"),
    ("/resize", {"cache_bytes": -1}, "cache_bytes", "greater than or equal to 0"),
    ("/resize", {"memory_utilization": 0}, "memory_utilization", "greater than 0"),
    ("/resize", {"memory_utilization": 1.5}, "memory_utilization", "less than or equal to 1"),
    ("/resize", '{"memory_utilization": NaN}', "memory_utilization", "finite number"),
    ("/resize", {"cache_bytes": CACHE, "preempt": "yes"}, "preempt", "valid boolean"),
    ("/resize", {"cache_bytes": CACHE, "bytes": 1}, "bytes", "unknown field 'bytes'"),
    ("/resize", "[4096]", None, "must be a JSON object"),
    ("/resize", b"", None, "not valid JSON"),
    ("/sleep", {"level": 2}, "level", "only level 1"),
    ("/sleep", {"level": "1"}, "level", "valid integer"),
    ("/sleep", {"level": 1, "tags": ["kv"]}, "tags", "unknown field 'tags'"),
    ("/wake_up", {"tags": ["weights"]}, "tags", "'tags'; this route takes no fields"),
    ("/wake_up", '{"tags": ', None, "not valid JSON"),
]


@pytest.fixture(scope="module")
def elastic():
    with serving(ELASTIC) as pair:
        yield pair


@pytest.mark.parametrize("path,body,param,words", BAD_BODIES,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD_BODIES)])
def test_a_bad_admin_body_is_400_naming_the_field_and_changes_nothing(elastic, path, body,
                                                                     param, words):
    server, engine = elastic
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    assert engine.cache_bytes == CACHE and is_sleeping(server) is False


def test_a_paged_cache_refuses_sleep_and_resize_with_409_and_goes_on_serving():
    with serving(PAGED) as (server, engine):
        before = engine.cache_bytes
        for path, body in (("/sleep", None), ("/resize", {"cache_bytes": 2 * before})):
            refused = post(server, path, body)
            assert refused.status_code == 409 and "'vmem'" in error_of(refused)["message"]
        assert is_sleeping(server) is False and engine.cache_bytes == before
        assert complete(server).status_code == 200   # the refused sleep refuses nothing after


def test_with_an_api_key_every_admin_route_needs_it():
    key = "admin-key-aaaaaaaa"
    with serving(ELASTIC, auth=AuthConfig((key,))) as (server, engine):
        routes = [("POST", "/sleep", {}), ("POST", "/wake_up", {}), ("GET", "/is_sleeping", None),
                  ("POST", "/resize", {"cache_bytes": 2 * CACHE})]
        for method, path, body in routes:
            for headers in ({}, {"Authorization": f"Bearer {key}x"}, {"Authorization": key}):
                refused = local_http.request(method, server.url + path, json=body, headers=headers)
                assert refused.status_code == 401, (path, headers)
                assert error_of(refused)["type"] == "authentication_error"
        assert engine.cache_bytes == CACHE and not engine.is_sleeping     # nothing ran
        bearer = {"Authorization": f"Bearer {key}"}
        for method, path, body in routes:
            assert local_http.request(method, server.url + path, json=body, headers=bearer,
                                      timeout=60).status_code == 200, path
        assert engine.cache_bytes == 2 * CACHE and not engine.is_sleeping


def test_an_idle_server_gives_its_budget_share_back_without_any_request():
    """The engine thread rebalances while idle: past the budget's idle_release_s the share
    shrinks to its minimum with no request and no step, and /metrics shows the new size."""
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.serve import Server
    from vmemkv.scheduler.budget import MemoryBudget

    from .conftest import NAME, model
    clock = [0.0]
    budget = MemoryBudget(CACHE, idle_release_s=1.0, clock=lambda: clock[0])
    with Engine(model(), memory_budget=budget, cache_bytes=CACHE, min_cache_bytes=16 * PAGE,
                **{k: v for k, v in ELASTIC.items() if k not in ("cache_bytes",
                                                                 "max_cache_bytes")}) as engine:
        with Server(engine, NAME, host="127.0.0.1", port=0).start() as server:
            tokens_of(complete(server))                 # served at the full share
            assert engine.cache_bytes == CACHE          # the clock stands still: kept
            # the engine thread has seen itself idle (at clock 0) before the clock moves on;
            # moved first, it would start counting its idle time at 10
            wait_for(lambda: engine.memory_share.idle_since is not None)
            assert engine.cache_bytes == CACHE
            clock[0] = 10.0                             # idle for longer than idle_release_s
            wait_for(lambda: engine.cache_bytes == 16 * PAGE)
            wait_for(lambda: gauges(server)["kv_cache_bytes"] == 16 * PAGE)
            assert budget.held_bytes == 16 * PAGE
            tokens_of(complete(server))                 # and it grows back for a request


def test_a_request_that_fits_only_a_grown_cache_is_503_and_200_after_resize():
    # started at 4 pages (32 tokens of a sequence), max 128 (64: max_context): /v1/models and
    # the length check use the cache at its max, so the first request is a 503 (retry), not a
    # 400; once /resize grows the cache it runs; shrunk to 0, even a short one is a 503
    start = dict(ELASTIC, cache_bytes=4 * PAGE, max_cache_bytes=128 * PAGE)
    with serving(start) as (server, engine):
        models = local_http.get(server.url + "/v1/models", timeout=30).json()
        assert models["data"][0]["max_model_len"] == 64
        long = {"prompt": list(range(1, 41)), "max_tokens": 20}
        refused = complete(server, **long)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        error = error_of(refused)
        assert "60 tokens do not fit the cache at its current size" in error["message"]
        assert "POST /resize" in error["message"]
        assert post(server, "/resize", {"cache_bytes": 128 * PAGE}).status_code == 200
        assert len(tokens_of(complete(server, **long))) == 20
        assert post(server, "/resize", {"cache_bytes": 0}).json() == {"cache_bytes": 0}
        assert complete(server, max_tokens=2).status_code == 503
        too_long = complete(server, prompt=list(range(1, 61)), max_tokens=5)   # 65 > 64: never
        assert too_long.status_code == 400 and error_of(too_long)["param"] == "max_tokens"
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
