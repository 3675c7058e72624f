"""Each API key's share of the requests in flight (``--max-requests-per-key``): one tenant could
take every ``--max-queue`` slot and every other tenant got 503 until it let go. Now a key past its
share gets 429 + Retry-After naming its own count only, with nothing taken (queue slot, response
budget, metrics), and the key's count is freed on the one path that frees its queue slot, so it
returns to 0 on every way a request ends. Driven in process: the app behind the Guard over a real
EngineThread whose FakeEngine is held, or the EngineThread alone."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from vmemkv.cli import main
from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve import KeyAtLimitError, Server, ServeConfigError, ServerOverloadedError
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.auth import AuthConfig, Guard
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import Ended, EngineThread
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.in_flight import RequestsInFlight, check_max_requests_per_key
from vmemkv.runtime.serve.limits import ServeLimits
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.submission import ResponseBudget, Submission

from ..engine.byte_tokenizer import byte_tokenizer
from . import local_http
from .conftest import NAME, VMEM, assert_memory_at_baseline, model, wait_until_idle
from .test_race_engine_thread import FAILS_ALONE, REJECTED, FailsAloneEngine

LONG = 10**9      # max_new_tokens of a request that runs until it is ended


def wait_for(condition, timeout_s: float = 60.0) -> None:
    """A deadlock guard, no timing check: the engine thread gets there in milliseconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never reached"
        time.sleep(0.002)


async def until(condition, timeout_s: float = 60.0) -> None:
    """``wait_for`` on the event loop."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never reached"
        await asyncio.sleep(0.002)


def test_a_key_past_its_share_is_429_naming_its_own_count_and_nothing_is_taken():
    in_flight = RequestsInFlight(max_requests=5, max_per_key=3)
    for key in ("a", "a", "a", "b"):
        in_flight.take(key)
    with pytest.raises(KeyAtLimitError) as refused:
        in_flight.take("a")
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    assert refused.value.body()["error"]["type"] == "rate_limit_exceeded"
    assert refused.value.message == ("this API key has 3 requests in flight and this request "
                                     "would add 1, past its limit of 3 (--max-requests-per-key); "
                                     "retry after 1 s, once some have finished")
    with pytest.raises(KeyAtLimitError) as refused:     # b's figures only: never a's 3, nor 4
        in_flight.check_key_room("b", 3)
    assert refused.value.message.startswith("this API key has 1 requests in flight and this "
                                            "request would add 3, past its limit of 3")
    with pytest.raises(ApiError) as never_fits:         # more prompts than the cap: a 400
        in_flight.check_key_room("b", 4)
    assert never_fits.value.status == 400 and never_fits.value.param == "prompt"
    assert (in_flight.total, in_flight.of_key("a"), in_flight.of_key("b")) == (4, 3, 1)
    in_flight.take("b")                                 # the queue is full now (5)
    with pytest.raises(KeyAtLimitError):                # a's own share is named first
        in_flight.take("a")
    with pytest.raises(ServerOverloadedError):
        in_flight.take("c")
    with pytest.raises(ServerOverloadedError):
        in_flight.take(None)                            # no key: the queue alone counts it
    assert (in_flight.total, in_flight.of_key("a"), in_flight.of_key("b"),
            in_flight.of_key("c")) == (5, 3, 2, 0)
    for key in ("a", "a", "b"):
        in_flight.give_back(key)
    in_flight.take("a")                                 # room again, for a as for the others
    assert (in_flight.total, in_flight.of_key("a"), in_flight.of_key("b")) == (3, 2, 1)


def _completion(client: httpx.AsyncClient, key: str):
    return client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _successes(metrics: ServeMetrics) -> float:
    return sum(float(v) for v in re.findall(r"vmemkv:request_success_total\{[^}]*\} (\S+)",
                                            metrics.render()))


def test_over_http_a_key_past_its_share_is_429_and_the_other_key_is_served():
    metrics, budget = ServeMetrics("m"), ResponseBudget(10**6)
    thread = EngineThread(FailsAloneEngine(), metrics, max_pending_requests=8, idle_wait_s=0.01,
                          response_budget=budget, max_requests_per_key=2)
    app = Guard(create_app(thread, metrics, ServedModel("m", byte_tokenizer(), 256, 64, 8)),
                ServeLimits(), AuthConfig(("key-a", "key-b")))
    release = threading.Event()

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            held = [asyncio.ensure_future(_completion(client, "key-a")) for _ in range(2)]
            await until(lambda: thread.in_flight.of_key("key-a") == 2)   # queued, held
            reserved_bytes = budget.held_bytes
            refused = await _completion(client, "key-a")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and error["param"] is None
            assert error["message"].startswith("this API key has 2 requests in flight")
            assert "--max-requests-per-key" in error["message"]
            # nothing taken: no queue slot, no budget, and it never counts as a request
            assert thread.pending_requests == 2 and budget.held_bytes == reserved_bytes
            other = asyncio.ensure_future(_completion(client, "key-b"))
            await until(lambda: thread.in_flight.of_key("key-b") == 1)   # not held back by a
            release.set()
            return [await call for call in held + [other]]

    thread.start()
    try:
        thread.call(lambda engine: release.wait(30))     # the engine thread holds here
        answers = asyncio.run(run())
    finally:
        release.set()
        thread.stop()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert thread.in_flight.of_key("key-a") == thread.in_flight.of_key("key-b") == 0
    assert thread.pending_requests == 0 and budget.held_bytes == 0
    assert _successes(metrics) == 3                      # the 429 is no request


def test_a_real_server_answers_429_to_a_key_past_its_share_and_serves_the_other_key(
        monkeypatch):
    gate, answers = threading.Event(), {}
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    with Engine(model(), None, **VMEM) as engine:
        with Server(engine, NAME, port=0, max_queue=2, auth=AuthConfig(("key-a", "key-b")),
                    max_requests_per_key=1).start() as server:
            step = engine.step
            monkeypatch.setattr(engine, "step", lambda: gate.wait(30) and step())   # hold it

            def post(key: str):
                return local_http.post(server.url + "/v1/completions", json=body, timeout=60,
                                       headers={"Authorization": f"Bearer {key}"})
            workers = [threading.Thread(target=lambda k=k: answers.update({k: post(k)}))
                       for k in ("key-a", "key-b")]
            workers[0].start()
            wait_for(lambda: server.engine_thread.in_flight.of_key("key-a") == 1)
            refused = post("key-a")
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_exceeded"
            assert "this API key has 1 requests in flight" in refused.json()["error"]["message"]
            workers[1].start()                  # the queue has room, and key b its share
            wait_for(lambda: server.engine_thread.in_flight.of_key("key-b") == 1)
            gate.set()
            for worker in workers:
                worker.join(60)
            wait_until_idle(server)
            assert [answers[k].status_code for k in ("key-a", "key-b")] == [200, 200]
            assert server.engine_thread.in_flight.of_key("key-a") == 0
        assert_memory_at_baseline(engine)


class StepRaisesEngine(FailsAloneEngine):
    """FailsAloneEngine whose next step raises when ``raise_in_step`` is set (every live request
    ends "failed"; the thread goes on), and which runs a beam search as one request."""
    raise_in_step = False

    def step(self) -> None:
        if self.raise_in_step:
            self.raise_in_step = False
            raise RuntimeError("a step failed")
        super().step()

    def add_beam_request(self, prompt, params, on_token, index=0):
        return self.add_request(prompt, params, on_token, index)


def test_every_way_a_request_ends_gives_its_keys_count_back():
    engine = StepRaisesEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), max_pending_requests=16,
                          idle_wait_s=0.01, max_requests_per_key=8)
    ends = {}

    def submit(name, prompt, params):
        return thread.submit(prompt, params, lambda item: isinstance(item, Ended) and
                             ends.setdefault(name, item.status), 0.0, key="a")

    # before the thread starts nothing ends: each request counts once, n and beams included
    submit("finished", [1], SamplingParams(max_new_tokens=2))
    refused = submit("refused", REJECTED, SamplingParams(max_new_tokens=2))
    submit("failed alone", FAILS_ALONE, SamplingParams(max_new_tokens=2))
    samples = submit("n=3", [1], SamplingParams(max_new_tokens=LONG, n=3))
    beams = submit("beams", [1], BeamSearchParams(beam_width=4, max_new_tokens=LONG))
    assert thread.in_flight.of_key("a") == thread.pending_requests == 5
    thread.start()
    try:
        wait_for(lambda: thread.in_flight.of_key("a") == 2)
        assert refused.exception() is not None
        assert ends == {"finished": "finished", "failed alone": "failed"}
        thread.abort(samples.result())                   # a client gone, or a shutdown's cut
        thread.abort(beams.result())
        wait_for(lambda: thread.in_flight.of_key("a") == 0)
        assert ends["n=3"] == ends["beams"] == "aborted"

        engine.raise_in_step = True                      # a step raised: every live one fails
        submit("step raised", [1], SamplingParams(max_new_tokens=LONG)).result(30)
        wait_for(lambda: "step raised" in ends)
        assert ends["step raised"] == "failed" and thread.in_flight.of_key("a") == 0

        submit("stopped", [1], SamplingParams(max_new_tokens=LONG)).result(30)
        assert thread.in_flight.of_key("a") == 1
    finally:
        thread.stop()                                    # the server stops: aborted
    assert ends["stopped"] == "aborted"
    assert thread.in_flight.of_key("a") == thread.pending_requests == 0


def test_a_submission_takes_every_prompt_or_none_and_closing_it_gives_them_back():
    budget = ResponseBudget(10**9)
    thread = EngineThread(FailsAloneEngine(), ServeMetrics("fake"), idle_wait_s=0.01,
                          response_budget=budget, max_requests_per_key=3)
    params = SamplingParams(max_new_tokens=10**6)     # runs until closed, within the limit

    async def run():
        first = Submission(thread, [[1], [2]], params, 0.0, key="a")
        await first.started()
        assert thread.in_flight.of_key("a") == 2
        held_bytes = budget.held_bytes
        with pytest.raises(KeyAtLimitError, match="has 2 requests in flight and this request "
                                                  "would add 2, past its limit of 3"):
            Submission(thread, [[3], [4]], params, 0.0, key="a")     # one would fit, not two
        assert thread.pending_requests == 2 and budget.held_bytes == held_bytes
        other = Submission(thread, [[5], [6], [7]], params, 0.0, key="b")
        await other.started()
        first.close()                                   # the client disconnected
        other.close()
        wait_for(lambda: thread.pending_requests == 0)
        assert thread.in_flight.of_key("a") == thread.in_flight.of_key("b") == 0

    thread.start()
    try:
        asyncio.run(run())
    finally:
        thread.stop()


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_the_cap_must_be_an_int_of_1_or_more(value):
    with pytest.raises(ServeConfigError, match=r"max_requests_per_key \(--max-requests-per-key\) "
                                               r"must be an int >= 1, got"):
        Server(None, "m", port=0, auth=AuthConfig(("k",)), max_requests_per_key=value)


def test_the_cap_needs_api_keys_in_the_server_and_the_cli(monkeypatch, capsys):
    with pytest.raises(ServeConfigError, match=r"--max-requests-per-key needs API keys"):
        Server(None, "m", port=0, max_requests_per_key=2)
    check_max_requests_per_key(None, ())                  # the default: no cap, no keys needed
    check_max_requests_per_key(2, ("k",))
    monkeypatch.delenv("VMEMKV_API_KEY", raising=False)
    code = main(["serve", "--max-requests-per-key", "2", "--port", "0", "--log-level",
                 "critical"])
    assert code == 2
    assert "ServeConfigError: --max-requests-per-key needs API keys" in capsys.readouterr().err
