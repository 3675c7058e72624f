"""What a client may send, and how long it may take: the server's limits, enforced before a
request reaches the engine, each refusal one log line naming the client.

    connections   at most ``max_connections`` open at once; one more is answered 503 and
                  closed at once (half-open connections cannot use up the file descriptors)
    headers       a connection must finish its request line and headers within
                  ``header_timeout_s`` of opening (or of its previous response): else closed.
                  An answer that starts before its request's body is all in says
                  ``Connection: close`` and ends the connection (the rest is never read: a
                  client trickling it kept the connection open for good, with no timer)
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
    response      ``max_response_bytes`` at most, bounded before anything is queued
                  (``check_response_bytes``: prompts x choices x tokens, each token at the
                  served tokenizer's ``TokenBytes``): a 400 naming the field to lower; the limit
                  itself is checked against the host's MemAvailable when the limits are made

``GuardedH11Protocol``: uvicorn's h11 protocol (the only one with the hooks they need) with the
connection and header rules; ``BodyLimits`` wraps an ASGI ``receive`` with the body rules.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import sys
from dataclasses import dataclass, replace
from typing import Optional

from vmemkv.vmem.host import meminfo_bytes

from .errors import ApiError, ServeConfigError

log = logging.getLogger("vmemkv.serve")

CLOSE = {"Connection": "close"}   # the rest of a refused body is never read
MAX_JSON_DEPTH = 32          # a completions body is 3 deep; 32 leaves room, refuses bombs
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20
# A response's JSON a token without a tokenizer (2026-12-06, tiny-llama: ids 0-255): 8-9 bytes,
# and 16-26 for each of its k + 1 logprob entries; a tokenizer's: ``ResponseBounds``
RESPONSE_BYTES_PER_TOKEN = 16
RESPONSE_BYTES_PER_LOGPROB = 80
FLOAT_JSON_BYTES = 24        # the longest repr of a float: -1.2345678901234567e-308
OFFSET_JSON_BYTES = 12       # a text_offset: under 10**12 characters
CHOICE_JSON_BYTES = 256      # a choice's keys, index, finish_reason and empty lists
ENVELOPE_JSON_BYTES = 1024   # id, object, created, usage and a model id of up to ~800 bytes
# Building a JSON response holds its TokenLogprobs, the dicts and the text at once: a
# completion with logprobs 20 took 4.4 KiB of RSS a token, 2.6 x its estimate (2026-12-06)
HELD_BYTES_PER_RESPONSE_BYTE = 4


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
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        for name, low in (("max_body_bytes", 1), ("max_connections", 1),
                          ("max_response_bytes", 1)):
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
        held_bytes = self.max_response_bytes * HELD_BYTES_PER_RESPONSE_BYTE
        available_bytes = meminfo_bytes("MemAvailable")
        if available_bytes is not None and held_bytes > available_bytes:
            raise ServeConfigError(
                f"max_response_bytes {self.max_response_bytes} (--max-response-bytes): building "
                f"a response that large holds about {held_bytes} bytes "
                f"({HELD_BYTES_PER_RESPONSE_BYTE} x), more than the host MemAvailable of "
                f"{available_bytes} bytes; lower it to at most "
                f"{available_bytes // HELD_BYTES_PER_RESPONSE_BYTE}")


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 2**20


@dataclass(frozen=True)
class TokenBytes:
    """Upper bounds on one response shape's JSON (starlette's: UTF-8, no spaces), in bytes: a
    token's text and id, with logprobs k ``logprobs_bytes`` more and k + 1 ``entry_bytes`` (its
    own and the top k); a choice's and the envelope's. Defaults: no tokenizer's, no overhead."""
    token_bytes: int = RESPONSE_BYTES_PER_TOKEN
    entry_bytes: int = RESPONSE_BYTES_PER_LOGPROB
    logprobs_bytes: int = 0
    choice_bytes: int = 0
    envelope_bytes: int = 0

    def per_token(self, logprobs: Optional[int]) -> int:
        """One token's bytes with ``logprobs`` k (None: none asked for)."""
        extra = 0 if logprobs is None else self.logprobs_bytes + (logprobs + 1) * self.entry_bytes
        return self.token_bytes + extra


@dataclass(frozen=True)
class ResponseBounds:
    """The ``TokenBytes`` of a completion and a chat completion from the served tokenizer's
    longest token: S, a token string's JSON bytes (``decode([id])``; without a tokenizer its id),
    N, S or its name's in a completion's logprobs, B, its chat ``bytes``, D, its id's digits. A
    token adds at most S + 1 to a text (a character split over tokens is no longer than their
    U+FFFD; the 1: a SentencePiece "▁" back)."""
    completion: TokenBytes
    chat: TokenBytes

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> "ResponseBounds":
        """Measured once per tokenizer (SmolLM2's 49,152 tokens: about 0.85 s), then cached."""
        d = len(str(max(vocab_size - 1, 0)))
        if tokenizer is None:        # ids in, ids out: today's constants, or the ids' digits
            return cls._of(d, d, d, d, RESPONSE_BYTES_PER_TOKEN, RESPONSE_BYTES_PER_LOGPROB)
        from .logprobs_format import longest_token_json   # (it needs TokenBytes' module)
        return cls._of(*longest_token_json(tokenizer, vocab_size), d)

    @classmethod
    def _of(cls, s: int, raw_bytes: int, name: int, digits: int, least_token_bytes: int = 0,
            least_entry_bytes: int = 0) -> "ResponseBounds":
        f, o, fixed = FLOAT_JSON_BYTES, OFFSET_JSON_BYTES, (CHOICE_JSON_BYTES, ENVELOPE_JSON_BYTES)
        token = max(least_token_bytes, (s + 1) + (digits + 1))     # its text; its id and ","
        # "tokens" "N",  "token_logprobs" F,  "text_offset" O,  "top_logprobs" {"N":F, ...},
        completion = TokenBytes(token, max(least_entry_bytes, name + f + 4), name + f + o + 8,
                                *fixed)
        # {"token":"S","logprob":F,"bytes":[255,...]},   (its own: ,"top_logprobs":[] more)
        chat_entry = s + f + max(4 * raw_bytes + 1, 2) + 34
        return cls(completion, TokenBytes(token, max(least_entry_bytes, chat_entry), 18, *fixed))


@dataclass(frozen=True)
class ResponseSize:
    """What bounds one request's response: ``prompts`` prompts, ``n`` choices each of at most
    ``max_tokens`` tokens with ``logprobs`` top entries a token (None: none), ``echo_tokens``
    prompt tokens in all echoed before each choice (``echo``), each at most ``bound``'s bytes."""
    prompts: int
    n: int
    max_tokens: int
    logprobs: Optional[int]
    echo_tokens: int = 0
    bound: TokenBytes = TokenBytes()

    @property
    def estimate_bytes(self) -> int:
        tokens = self.n * (self.prompts * self.max_tokens + self.echo_tokens)
        return tokens * self.bound.per_token(self.logprobs) + self.fixed_bytes

    @property
    def fixed_bytes(self) -> int:      # its envelope and choices, whatever their tokens
        return self.bound.envelope_bytes + self.n * self.prompts * self.bound.choice_bytes


def check_response_bytes(size: ResponseSize, max_response_bytes: int, chat: bool = False,
                         max_param: Optional[str] = None) -> None:
    """ApiError 400 when ``size``'s response could pass ``max_response_bytes``: the message
    gives both numbers, ``param`` the field to lower (logprobs first, the strongest lever, then
    n, then max_tokens, else the prompts), with the most of it that fits. ``max_param``: the
    field that set max_tokens as the client sent it (chat's ``max_completion_tokens``); None:
    max_tokens (a chat's message names both)."""
    need_bytes = size.estimate_bytes
    if need_bytes <= max_response_bytes:
        return
    field, fits = _lever(size, max_response_bytes, chat, max_param)
    echo = f" + {size.echo_tokens} echoed prompt tokens" if size.echo_tokens else ""
    asked = "" if size.logprobs is None else f" with logprobs {size.logprobs}"
    raise ApiError(400, f"{field}: the response could reach about {need_bytes:,} bytes (n "
                        f"{size.n} x ({size.prompts} prompt(s) x {size.max_tokens} tokens{echo}) "
                        f"at about {size.bound.per_token(size.logprobs)} bytes a token{asked}), "
                        f"more than this server's limit of {max_response_bytes:,} bytes "
                        f"(--max-response-bytes); {fits}", field)


def _lever(size: ResponseSize, limit_bytes: int, chat: bool, max_param: Optional[str]):
    """(the field to lower, what of it fits) for a response over ``limit_bytes``."""
    if size.logprobs is not None:
        for k in range(size.logprobs - 1, -1, -1):
            if replace(size, logprobs=k).estimate_bytes <= limit_bytes:
                name = "top_logprobs" if chat else "logprobs"
                return name, f"{name} {k} or less fits"
        if replace(size, logprobs=None).estimate_bytes <= limit_bytes:
            return "logprobs", "it fits without logprobs"
    most_n = (limit_bytes - size.bound.envelope_bytes) * size.n \
        // (size.estimate_bytes - size.bound.envelope_bytes)        # choices cost alike
    if 1 <= most_n < size.n:
        return "n", f"n {most_n} or less fits"
    per_token = size.bound.per_token(size.logprobs)
    most_tokens = (limit_bytes - size.fixed_bytes - size.n * size.echo_tokens * per_token) \
        // (size.n * size.prompts * per_token)
    if most_tokens >= 1:
        if max_param is not None:
            return max_param, f"{max_param} {most_tokens} or less fits"
        name = "max_tokens (or max_completion_tokens)" if chat else "max_tokens"
        return "max_tokens", f"{name} {most_tokens} or less fits"
    return "prompt", "send fewer prompts at a time (or shorter ones, with echo)"


def loads_json(body: bytes):
    """``json.loads(body)``, or ApiError 400 when it is not JSON or nests deeper than
    ``MAX_JSON_DEPTH`` (past the interpreter's recursion limit the parser itself stops)."""
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except ValueError:   # Python's int limit: its message told the client to raise it
        raise ApiError(400, f"the request body holds an integer of more than "
                            f"{sys.get_int_max_str_digits()} digits (no field takes one)") from None
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

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:   # a new request: its answer may have to say close
                self.cycle.send = _closing_send(self.cycle, self.conn)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._serving():          # the request line and headers are in: the app's turn
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
                # the rest of its body never read: nothing would bound how long it may trickle
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
                self.transport.close()
            super().on_response_complete()
            self._arm_header_timer()      # the next request on this connection has as long

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            cancel_timer(self, "_header_timer")

        def _serving(self) -> bool:
            """Whether a request's answer is under way (the app's own limits bound it); else
            the server waits on the client, and the header timer must be armed."""
            return self.cycle is not None and not self.cycle.response_complete \
                and self.conn.their_state is not h11.IDLE

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self._serving():
                return
            what = "incomplete" if self.conn.trailing_data[0] else "not sent"
            log.warning("dropped %s: request headers %s within %g s", _peer(self.client), what,
                        limits.header_timeout_s)
            self.transport.close()

    def _closing_send(cycle, conn):
        """``cycle.send``, whose response says ``Connection: close`` when it starts before the
        request's body is all in: the rest is never read, the connection ends with the answer."""
        send = cycle.send

        async def closing_send(message) -> None:
            if message["type"] == "http.response.start" and conn.their_state is not h11.DONE:
                headers = list(message.get("headers", []))
                if (b"connection", b"close") not in [(k.lower(), v.lower()) for k, v in headers]:
                    message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        return closing_send

    return GuardedH11Protocol


def cancel_timer(owner, name: str) -> None:
    """Cancel the timer ``owner.<name>`` (a loop's ``call_later`` handle) if one is armed,
    and forget it."""
    timer = getattr(owner, name, None)
    if timer is not None:
        timer.cancel()
        setattr(owner, name, None)


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
