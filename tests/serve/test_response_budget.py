"""Clients that never read cannot hold the server's memory: a request's --max-response-bytes
estimate is reserved from a server-wide budget (--max-response-memory-bytes) until its
response is out or its connection gone (past it: 503 + Retry-After), and a connection whose
client reads nothing for --send-timeout is dropped. Before, each request's --max-queue slot
was freed when the engine finished it: 10 non-reading JSON clients (nonreader_json.py) held
their answers in uvicorn's buffers, stream tokens piled up behind a paused transport, up to
--max-connections x --max-response-bytes (~16 GiB at the defaults). Driven in process: the
app through ASGI calls whose ``send`` blocks as uvicorn's does on a full buffer, the
protocol's timer on a fake loop; the host's MemAvailable is faked."""
from __future__ import annotations

import asyncio
import json

import pytest

from vmemkv.cli import main
from vmemkv.runtime.serve import limits, submission as submission_module
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.errors import ApiError, ServeConfigError
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.server import check_send_timeout, send_timed
from vmemkv.runtime.serve.submission import ResponseBudget

from ..engine.byte_tokenizer import byte_tokenizer
from .test_app_submission import TwoTokenEngineThread

MiB = 2**20


def test_a_reservation_past_the_budget_is_503_with_retry_after_and_reserves_nothing():
    budget = ResponseBudget(100)
    first = budget.reserve(64)
    with pytest.raises(ApiError) as refused:
        budget.reserve(37)
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    # never what the others hold: with --salt-per-key that was another tenant's request size
    assert ("response budget of 100 bytes (--max-response-memory-bytes: responses being made "
            "or not yet read by their clients) is too full now for this one, which could take "
            "37" in refused.value.message) and "64" not in refused.value.message
    assert budget.held_bytes == 64
    second = budget.reserve(36)                      # exactly to the budget: taken
    assert budget.held_bytes == 100
    first.release()
    first.release()                                  # once only
    assert budget.held_bytes == 36
    second.release()
    assert budget.held_bytes == 0


def test_the_budget_defaults_to_4_responses_and_is_checked_against_memavailable(monkeypatch):
    monkeypatch.setattr(submission_module, "meminfo_bytes", lambda field: 8192 * MiB)
    assert ResponseBudget.of(64 * MiB).total_bytes == 256 * MiB
    assert ResponseBudget.of(64 * MiB, 2048 * MiB).total_bytes == 2048 * MiB
    with pytest.raises(ServeConfigError, match=r"max_response_memory_bytes 4294967296 "
                       r"\(--max-response-memory-bytes\): building that much response holds "
                       r"about 17179869184 bytes \(4 x\), more than the host MemAvailable of "
                       r"8589934592 bytes; lower it to at most 2147483648"):
        ResponseBudget.of(64 * MiB, 4096 * MiB)
    with pytest.raises(ServeConfigError, match=r"must be an int >= max_response_bytes 67108864"):
        ResponseBudget.of(64 * MiB, 32 * MiB)
    monkeypatch.setattr(submission_module, "meminfo_bytes", lambda field: 512 * MiB)
    assert ResponseBudget.of(64 * MiB).total_bytes == 128 * MiB      # the default fits memory
    monkeypatch.setattr(submission_module, "meminfo_bytes", lambda field: 100 * MiB)
    assert ResponseBudget.of(16 * MiB).total_bytes == 25 * MiB
    assert ResponseBudget.of(64 * MiB).total_bytes == 64 * MiB       # never under one response


def test_the_cli_refuses_a_budget_past_memory_before_the_model_loads(monkeypatch, capsys):
    for module in (limits, submission_module):
        monkeypatch.setattr(module, "meminfo_bytes", lambda field: 1024 * MiB)
    code = main(["serve", "--max-response-memory-bytes", "512MiB", "--port", "0",
                 "--log-level", "critical"])
    err = capsys.readouterr().err
    assert code == 2
    assert "ServeConfigError: max_response_memory_bytes 536870912 (--max-response-memory-bytes)" \
        in err and "lower it to at most 268435456" in err


class Exchange:
    """One ASGI call of the app: ``send`` blocks, as uvicorn's does on a full buffer, on the
    empty last body message until ``drained`` is set."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.messages, self.drained, self.waiting = [], asyncio.Event(), asyncio.Event()
        raw = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80)}
        bodies = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()       # the client stays: no disconnect

        async def send(message):
            if message["type"] == "http.response.body" and not message.get("more_body") \
                    and message.get("body") == b"":
                self.waiting.set()
                await self.drained.wait()
            self.messages.append(message)

        self.task = asyncio.ensure_future(app(scope, receive, send))

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


def _app(budget_bytes: int):
    engine_thread = TwoTokenEngineThread()
    engine_thread.response_budget = ResponseBudget(budget_bytes)
    served = ServedModel("m", byte_tokenizer(chat_template=True), 256, 64, 8)
    return create_app(engine_thread, ServeMetrics("m"), served), engine_thread


@pytest.mark.parametrize("stream, reserved_bytes", [(False, 1324), (True, 3246)])
def test_a_response_holds_its_budget_until_its_client_has_read_it(stream, reserved_bytes):
    # max_tokens 4: 4 x 11 (the byte tokenizer's bound) + 256 (a choice) + 1,024 (the
    # envelope) = 1,324 bytes reserved; streamed, each token's chunk (its envelope, naming
    # the model "m", 149, its choice's keys, 256, and a space, 1) more, and two envelopes
    # once: 1,324 + 4 x 406 + 2 x 149 = 3,246. The budget holds one of them and not two
    budget_bytes = reserved_bytes + 676
    body = {"prompt": [1, 2], "max_tokens": 4, "stream": stream}

    async def run():
        app, engine_thread = _app(budget_bytes)
        budget = engine_thread.response_budget
        unread = Exchange(app, "/v1/completions", body)
        await asyncio.wait_for(unread.waiting.wait(), 30)   # its answer waits on the client
        assert not unread.task.done() and unread.status == 200 and b"66]" in unread.body
        assert budget.held_bytes == reserved_bytes   # the engine has finished; the client has not
        refused = Exchange(app, "/v1/completions", body)
        await refused.task
        assert refused.status == 503 and (b"retry-after", b"1") in refused.messages[0]["headers"]
        error = json.loads(refused.body)["error"]
        assert f"budget of {budget_bytes:,} bytes" in error["message"] \
            and f"this one, which could take {reserved_bytes:,};" in error["message"]
        assert len(engine_thread.submitted) == 1          # nothing queued for it
        unread.drained.set()                  # the client reads: its budget comes back
        await unread.task
        assert budget.held_bytes == 0
        served = Exchange(app, "/v1/completions", body)
        served.drained.set()
        await served.task
        assert served.status == 200 and budget.held_bytes == 0
        assert len(engine_thread.submitted) == 2

    asyncio.run(run())


def test_a_refused_request_gives_its_reservation_back():
    # over --max-queue part-way (the fake refuses the second prompt): nothing stays held
    class FullAfterOne(TwoTokenEngineThread):
        def submit(self, ids, params, sink, arrival_s, index=0, key=None):
            if self.submitted:
                raise ApiError(503, "full", headers={"Retry-After": "1"})
            return super().submit(ids, params, sink, arrival_s, index)

    async def run():
        engine_thread = FullAfterOne()
        engine_thread.response_budget = ResponseBudget(1000)
        app = create_app(engine_thread, ServeMetrics("m"),
                         ServedModel("m", byte_tokenizer(), 256, 64, 8))
        call = Exchange(app, "/v1/completions", {"prompt": [[1], [2]], "max_tokens": 4})
        call.drained.set()
        await call.task
        assert call.status == 503 and engine_thread.response_budget.held_bytes == 0

    asyncio.run(run())


class _FakeLoop:
    def __init__(self) -> None:
        self.timers = []

    def call_later(self, delay_s, callback):
        timer = asyncio.TimerHandle(0.0, callback, (), asyncio.new_event_loop())
        self.timers.append((delay_s, timer))
        return timer


class _FakeTransport:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Protocol:
    """What send_timed's class needs of uvicorn's protocol."""

    def __init__(self) -> None:
        self.loop, self.transport, self.client = _FakeLoop(), _FakeTransport(), ("10.0.0.1", 7)
        self.calls = []

    def pause_writing(self) -> None:
        self.calls.append("pause")

    def resume_writing(self) -> None:
        self.calls.append("resume")

    def connection_lost(self, exc) -> None:
        self.calls.append("lost")


def test_a_connection_write_paused_for_the_send_timeout_is_aborted(caplog):
    protocol = send_timed(_Protocol, 45.0)()
    protocol.pause_writing()                  # the client reads nothing: the buffer fills
    (delay_s, first), = protocol.loop.timers
    assert delay_s == 45.0 and protocol.calls == ["pause"]
    protocol.resume_writing()                 # it read: the timer is off
    assert first.cancelled() and protocol.calls == ["pause", "resume"]
    protocol.pause_writing()
    delay_s, second = protocol.loop.timers[-1]
    second._run()                             # 45 s paused
    assert protocol.transport.aborted
    assert "dropped 10.0.0.1:7: it read nothing of its answer for 45 s (--send-timeout)" \
        in caplog.text
    protocol.pause_writing()
    protocol.connection_lost(None)            # gone: no timer left behind
    assert protocol.loop.timers[-1][1].cancelled() and protocol.calls[-1] == "lost"


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_a_send_timeout_that_is_not_a_positive_finite_number_is_refused(value):
    with pytest.raises(ServeConfigError, match=r"send_timeout_s \(--send-timeout\) must be"):
        check_send_timeout(value)


def test_a_submission_the_queue_refuses_gives_its_reservation_back():
    """The queue full at the first prompt (503): the submission raises it and holds none of
    the response budget it reserved (else each refusal would shrink the budget for good)."""
    from vmemkv.runtime.engine import SamplingParams
    from vmemkv.runtime.serve.errors import ServerOverloadedError
    from vmemkv.runtime.serve.submission import Submission

    class FullEngineThread:
        max_response_bytes = limits.DEFAULT_MAX_RESPONSE_BYTES

        def __init__(self) -> None:
            self.response_budget = ResponseBudget(MiB)

        def submit(self, *args, **kwargs):
            raise ServerOverloadedError(1)

    thread = FullEngineThread()

    async def submit():
        Submission(thread, [[1, 2, 3]], SamplingParams(max_new_tokens=4), arrival_s=0.0)

    with pytest.raises(ServerOverloadedError):
        asyncio.run(submit())
    assert thread.response_budget.held_bytes == 0
