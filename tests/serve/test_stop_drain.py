"""Server.stop() honours the drain: requests in flight run on for ``shutdown_timeout_s`` (it
joined the HTTP thread for a fixed 10 s, then stopped the engine thread under them); a request
the engine thread's stop cuts gets the shutdown's 503, never a 500 "internal server error"."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx

from vmemkv.runtime.serve.limits import ServeLimits

from . import local_http
from .conftest import VMEM, assert_memory_at_baseline, serving

BODY = {"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def held(thread) -> threading.Event:
    """The engine thread blocked on the returned gate (up to 60 s), once it runs the blocking
    call: that call is off its queue, so ``queued_commands`` counts requests only (counted while
    still queued, it let ``queued`` return before the request arrived, and stop() closed the
    socket under it: 'connection refused' on a loaded machine)."""
    gate, entered = threading.Event(), threading.Event()

    def block(_) -> None:
        entered.set()
        gate.wait(60)
    thread.call(block)
    assert entered.wait(60), "the engine thread never ran the call"
    return gate


def queued(thread, count: int) -> None:
    deadline = time.monotonic() + 60   # turns a hang into a failure; no timing check
    while thread.queued_commands < count:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.01)


class JoinsTwentyTimesFaster:
    """The server's HTTP thread, each join's timeout cut twentyfold, so the old fixed 10 s join
    ends after 0.5 s while stop()'s (the drain, its grace and the margin) still lasts minutes."""
    SPEEDUP = 20

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def join(self, timeout=None) -> None:
        self.thread.join(None if timeout is None else timeout / self.SPEEDUP)

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def test_stop_lets_a_request_in_flight_finish_within_shutdown_timeout_s(monkeypatch):
    """The request is held past the old fixed 10 s join (0.5 s here: the HTTP thread's joins
    run 20x fast, so the check waits half a second, not 10), inside a 3,000 s drain: it is
    answered 200, before stop() returns. (The drain is long so that a loaded machine, where the request takes a while after
    the gate opens, cannot end it first: a 30 s drain failed so; it is 150 s at 20x.)"""
    with serving(VMEM, limits=ServeLimits(shutdown_timeout_s=3000)) as (server, engine):
        assert isinstance(server._thread, threading.Thread)
        monkeypatch.setattr(server, "_thread", JoinsTwentyTimesFaster(server._thread))
        thread = server.engine_thread
        gate = held(thread)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answer = pool.submit(httpx.post, server.url + "/v1/completions", json=BODY,
                                 timeout=120)
            queued(thread, 1)
            stopped = pool.submit(server.stop)
            time.sleep(10.5 / JoinsTwentyTimesFaster.SPEEDUP)
            assert not stopped.done()              # still draining past the old fixed 10 s
            gate.set()
            r = answer.result()
            assert r.status_code == 200, r.text
            stopped.result()
        assert len(r.json()["choices"][0]["token_ids"]) == 8
        assert_memory_at_baseline(engine)


def test_a_request_cut_by_the_engine_thread_stopping_is_a_503_not_a_500():
    with serving(VMEM) as (server, engine):
        thread = server.engine_thread
        gate = held(thread)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answer = pool.submit(httpx.post, server.url + "/v1/completions", json=BODY,
                                 timeout=120)
            stream = pool.submit(streamed, server.url)
            queued(thread, 2)
            stopping = pool.submit(thread.stop)
            time.sleep(0.2)
            gate.set()
            stopping.result()
            r, lines = answer.result(), stream.result()
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert r.headers["retry-after"] == "1"
        assert '"code": null' in lines[-2] and "shutting down" in lines[-2]
        assert lines[-1] == "data: [DONE]"
        assert_memory_at_baseline(engine)


def streamed(url: str) -> list:
    with local_http.stream("POST", url + "/v1/completions", json={**BODY, "stream": True},
                           timeout=120) as r:
        return [line for line in r.iter_lines() if line]
