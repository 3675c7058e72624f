"""limits.GuardedH11Protocol driven directly (a fake transport, no socket, no sleeps): whenever
the server waits on the client, something bounds the wait. A request whose body the route
never reads (GET /health with a Content-Length, half a chunk, a POST to a 404 path) is
answered with ``Connection: close`` and the connection ends with the answer: it used to stay
open with no timer at all once the client sent one more byte, and 256 such sockets (13.5 KB
sent) filled --max-connections for good."""
from __future__ import annotations

import asyncio

import pytest

uvicorn = pytest.importorskip("uvicorn")
from uvicorn.server import ServerState  # noqa: E402

from vmemkv.runtime.serve.limits import ServeLimits, guarded_protocol  # noqa: E402

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n"


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = bytearray(), False

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope, receive, send) -> None:
    """/health answers without reading the body, /read reads it all, anything else is a 404
    that reads nothing."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/read":
        while (await receive()).get("more_body"):
            pass
    status = 404 if scope["path"] not in ("/health", "/read") else 200
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def connect():
    loop = asyncio.new_event_loop()
    state = ServerState()
    protocol_class = guarded_protocol(ServeLimits(header_timeout_s=5.0, max_connections=8))
    config = uvicorn.Config(app, http=protocol_class, log_level="critical", lifespan="off")

    def opened():
        protocol = protocol_class(config=config, server_state=state, app_state={}, _loop=loop)
        transport = FakeTransport()
        protocol.connection_made(transport)
        return protocol, transport

    def settle() -> None:   # every request task runs to its end
        if state.tasks:
            loop.run_until_complete(asyncio.gather(*state.tasks))

    yield opened, settle
    loop.close()


def bounded(protocol, transport) -> bool:
    """The connection is closed, or the header timer is armed and closes it when it fires."""
    if transport.closed:
        return True
    timer = protocol._header_timer
    if timer is None or timer.cancelled():
        return False
    protocol._headers_late()              # what the timer does when it fires
    return transport.closed


@pytest.mark.parametrize("head, rest", [
    (HEALTH, b"x"),                                                           # 1 of 9 bytes
    (b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nab"),
    (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b"x"),  # a 404
])
def test_an_answer_before_the_body_is_in_says_close_and_ends_the_connection(connect, head, rest):
    protocol, transport = connect[0]()
    protocol.data_received(head)
    connect[1]()
    answer = bytes(transport.written)
    assert answer.split(b"\r\n")[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found")
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert transport.closed
    protocol.data_received(rest)          # the attacker's byte after the answer: still closed
    assert transport.closed and bytes(transport.written) == answer


def test_every_state_the_server_waits_on_the_client_in_has_a_timer(connect):
    opened, settle = connect
    fresh = opened()
    assert bounded(*fresh)                                     # nothing sent yet
    half_headers = opened()
    half_headers[0].data_received(b"GET /health HTTP/1.1\r\nHo")
    assert bounded(*half_headers)
    protocol, transport = opened()                             # a body read in full, answered
    protocol.data_received(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    settle()
    assert transport.written.startswith(b"HTTP/1.1 200 OK") and not transport.closed
    assert b"connection: close" not in transport.written.lower()   # kept alive: body all in
    protocol.data_received(b"GET /hea")                        # the next request, half sent
    assert bounded(protocol, transport)
    leftover, leftover_transport = opened()                    # answered, 8 body bytes unread
    leftover.data_received(HEALTH + b"x")
    settle()
    leftover.data_received(b"y")
    assert bounded(leftover, leftover_transport)


def test_a_request_being_served_is_not_cut_by_the_header_timer(connect):
    opened, settle = connect
    protocol, transport = opened()
    protocol.data_received(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\na")
    assert protocol._header_timer is None          # the body's own limit (BodyLimits) has it
    protocol._headers_late()
    assert not transport.closed
    protocol.data_received(b"bc")
    settle()
    assert transport.written.startswith(b"HTTP/1.1 200 OK") and not transport.closed


def _read_body(chunks, max_body_bytes: int) -> bytes:
    """The body ``chunks`` (one ASGI message each) as ``BodyLimits`` lets the app read it."""
    from vmemkv.runtime.serve.limits import BodyLimits

    messages = iter([{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                     for i, chunk in enumerate(chunks)])

    async def receive():
        return next(messages)

    async def read() -> bytes:
        body = BodyLimits(receive, {"client": ("10.0.0.1", 5)},
                          ServeLimits(max_body_bytes=max_body_bytes))
        got = b""
        while True:
            message = await body()
            got += message["body"]
            if not message["more_body"]:
                return got
    return asyncio.run(read())


def test_a_chunked_body_of_exactly_max_body_bytes_is_read_and_one_byte_more_is_413():
    from vmemkv.runtime.serve.errors import ApiError

    chunks = [b"a" * 6, b"b" * 4]
    assert _read_body(chunks, 10) == b"aaaaaabbbb"
    with pytest.raises(ApiError) as refused:
        _read_body(chunks, 9)
    assert refused.value.status == 413 and "9 bytes" in str(refused.value.body())
