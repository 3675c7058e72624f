"""What a client may send, and how long it may take: the server's limits, enforced before a
request reaches the engine, each refusal one log line naming the client.

    connections   at most ``max_connections`` open at once; one more is answered 503 and
                  closed at once (half-open connections cannot use up the file descriptors)
    headers       a connection must finish its request line and headers within
                  ``header_timeout_s`` of opening (or of its previous response): else closed
    body          ``max_body_bytes`` at most: a larger Content-Length is refused 413 before
                  reading, a longer chunked body 413 as soon as it passes the limit; the whole
                  body within ``body_timeout_s`` of the headers, else 408
    JSON          at most ``MAX_JSON_DEPTH`` levels of nesting: 400 before it is parsed;
                  bodies are parsed and checked off the event loop, list fields' lengths
                  before their entries (protocol.FIELD_ENTRIES)
    templates     a request's own ``chat_template`` (Jinja: any loop a client writes runs on
                  the server's CPU) only with ``trust_request_chat_template``, else a 400
                  naming it (vLLM's ``--trust-request-chat-template``); prompts are rendered
                  and tokenized off the event loop, so a long one never stalls other clients

``GuardedH11Protocol`` is uvicorn's h11 protocol with the connection and header rules (a
subclass: the h11 one is the only one whose hooks those rules need); ``BodyLimits`` wraps an
ASGI ``receive`` with the body rules.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Optional

from .errors import ApiError, ServeConfigError

log = logging.getLogger("vmemkv.serve")

CLOSE = {"Connection": "close"}   # the rest of a refused body is never read
MAX_JSON_DEPTH = 32          # a completions body is 3 deep; 32 leaves room, refuses bombs


@dataclass(frozen=True)
class ServeLimits:
    """The limits above; sizes in bytes, times in seconds. ``max_connections`` None: 256, or
    fewer when ``ulimit -n`` leaves fewer file descriptors (half of them, the rest for the
    process)."""
    max_body_bytes: int = 4 * 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: Optional[int] = None
    shutdown_timeout_s: float = 10.0
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_body_bytes", 1), ("max_connections", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ServeConfigError(f"{name} must be an int >= {low}, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < float("inf") or (name != "shutdown_timeout_s" and not value):
                raise ServeConfigError(f"{name} must be a finite number of seconds > 0 "
                                       f"(>= 0 for shutdown_timeout_s), got {value!r}")
        fds = _fd_limit()
        if self.max_connections is None:
            object.__setattr__(self, "max_connections", min(256, max(1, fds // 2)))
        elif self.max_connections > fds - 32:
            raise ServeConfigError(f"max_connections {self.max_connections} needs more file "
                                   f"descriptors than ulimit -n {fds} leaves (32 are kept for "
                                   f"the process); lower it or raise ulimit -n")


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 2**20


def loads_json(body: bytes):
    """``json.loads(body)``, or ApiError 400 when it is not JSON or nests deeper than
    ``MAX_JSON_DEPTH`` (past the interpreter's recursion limit the parser itself stops)."""
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if _depth_over(obj, MAX_JSON_DEPTH):
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return obj


def _depth_over(obj, limit: int) -> bool:
    """Whether ``obj`` nests deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)] if isinstance(obj, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (list, dict)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def client_name(scope) -> str:
    return _peer(scope.get("client"))


class BodyLimits:
    """An ASGI ``receive`` that enforces the body rules: ApiError 413 past ``max_body_bytes``,
    408 past ``body_timeout_s`` (the app answers it like any ApiError); a client gone
    mid-body is one log line and ApiError 400 (nobody reads the answer)."""

    def __init__(self, receive, scope, limits: ServeLimits) -> None:
        self._receive, self._scope, self._limits = receive, scope, limits
        self._deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
        self._seen, self._done = 0, False

    async def __call__(self):
        if self._done:                      # the body is in: disconnect watches pass through
            return await self._receive()
        left = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0.0))
        except asyncio.TimeoutError:
            log.warning("dropped %s: request body not received within %g s",
                        client_name(self._scope), self._limits.body_timeout_s)
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self._limits.body_timeout_s:g} s", headers=CLOSE) from None
        if message["type"] == "http.disconnect":
            self._done = True
            log.warning("dropped %s: it disconnected before its request body was complete",
                     client_name(self._scope))
            raise ApiError(400, "the client disconnected before the request body was complete")
        self._seen += len(message.get("body", b""))
        if self._seen > self._limits.max_body_bytes:
            self._done = True
            log.warning("refused %s: request body over %d bytes", client_name(self._scope),
                        self._limits.max_body_bytes)
            raise too_large(self._limits)
        self._done = not message.get("more_body", False)
        return message


def too_large(limits: ServeLimits) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of "
                         f"{limits.max_body_bytes} bytes (--max-body-bytes)", headers=CLOSE)


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s")


def guarded_protocol(limits: ServeLimits):
    """uvicorn's h11 protocol class with the connection and header rules of ``limits``
    (uvicorn.Config(http=...) takes the class)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("refused %s: %d connections open, the limit (--max-connections)",
                            _peer(self.client), limits.max_connections)
                body = ApiError(503, f"the server is at its limit of {limits.max_connections} "
                                     f"open connections (--max-connections)").body()
                data = json.dumps(body).encode()
                transport.write(_BUSY % (len(data), data))
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:   # the request line and headers are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()      # the next request on this connection has as long

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            what = "incomplete" if self.conn.trailing_data[0] else "not sent"
            log.warning("dropped %s: request headers %s within %g s", _peer(self.client), what,
                        limits.header_timeout_s)
            self.transport.close()

    return GuardedH11Protocol


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
