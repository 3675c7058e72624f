"""Typed errors of the server: each HTTP error a client can get, in OpenAI's JSON shape."""
from __future__ import annotations

from typing import Dict, Optional

from ..errors import RuntimeKVError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_exceeded", 500: "internal_server_error", 503: "server_overloaded"}


class ServeError(RuntimeKVError):
    """Base class of the server's errors."""


class ServeConfigError(ServeError, ValueError):
    """A ``vmemkv serve`` / ``vmemkv bench serve`` setting is wrong (a missing extra, a bad
    value); the message names it."""


class ApiError(ServeError):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``.
    ``param`` names the request field at fault (None when it is the whole request)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body; text that is not Unicode (a lone surrogate a request sent, "\\ud800"
        in JSON, quoted back in the message) is backslash-escaped, so the answer can be encoded
        (it was a 500 in place of the 400)."""
        return {"error": {"message": escape_surrogates(self.message),
                          "type": ERROR_TYPES.get(self.status, "error"),
                          "param": None if self.param is None else escape_surrogates(self.param),
                          "code": None}}


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\ud800``): valid UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ServerOverloadedError(ApiError):
    """503: the bounded queue is full; the client should retry after ``retry_after_s``."""

    def __init__(self, live_requests: int, retry_after_s: int = 1) -> None:
        super().__init__(503, f"the server is at its limit of {live_requests} requests in flight "
                              f"(--max-queue); retry after {retry_after_s} s",
                         headers={"Retry-After": str(retry_after_s)})


class KeyAtLimitError(ApiError):
    """429: this API key has its ``--max-requests-per-key`` requests in flight; the message
    names this key's own count only (never another key's, nor the server's)."""

    def __init__(self, in_flight: int, count: int, max_per_key: int,
                 retry_after_s: int = 1) -> None:
        super().__init__(429, f"this API key has {in_flight} requests in flight and this request "
                              f"would add {count}, past its limit of {max_per_key} "
                              f"(--max-requests-per-key); retry after {retry_after_s} s, once "
                              f"some have finished", headers={"Retry-After": str(retry_after_s)})


class KeyBudgetError(ApiError):
    """429: the responses this API key holds (being made, or not yet read by its clients) and
    this one would pass its share of the server's response budget; the message names this
    key's own figures only (never another key's, nor what the whole budget holds)."""

    def __init__(self, held_bytes: int, size_bytes: int, share_bytes: int,
                 retry_after_s: int = 1) -> None:
        super().__init__(429, f"this API key's responses (being made or not yet read) hold "
                              f"{held_bytes:,} bytes and this one could take {size_bytes:,}, "
                              f"past its share of {share_bytes:,} bytes of the server's response "
                              f"budget (--max-response-memory-bytes x --max-requests-per-key / "
                              f"--max-queue, at least --max-response-bytes); retry after "
                              f"{retry_after_s} s, once some have been read",
                         headers={"Retry-After": str(retry_after_s)})


class EngineAsleepError(ApiError):
    """503: the engine is asleep (``POST /sleep``); a new request is refused until
    ``POST /wake_up`` (the requests queued before the sleep wait and are served after it)."""

    def __init__(self, retry_after_s: int = 5) -> None:
        super().__init__(503, f"the engine is asleep (POST /sleep: its KV-cache memory is given "
                              f"back); retry after {retry_after_s} s, or POST /wake_up",
                         headers={"Retry-After": str(retry_after_s)})


def cache_shrunk(message: str, retry_after_s: int = 5) -> ApiError:
    """503: the request fits the KV cache at its largest, not at the size POST /resize left."""
    return ApiError(503, f"{message} (the KV cache is below its max_cache_bytes: POST /resize "
                         f"grows it); retry after {retry_after_s} s",
                    headers={"Retry-After": str(retry_after_s)})


def internal_error() -> ApiError:
    """What a client sees of an unexpected failure: no traceback, no internals."""
    return ApiError(500, "internal server error; the server log has the details")


def cannot_hold(param: str, beams: bool = False) -> ApiError:
    """400: the engine failed this request alone because its cache can never hold it (``beams``:
    a beam group that, preempted, must come back with each beam's own copy and does not fit
    even an empty cache): what the client can change, ``param``, named as the client sent it
    (a beam search's width: ``n`` where ``beam_width`` was left out); no internals (sequence
    ids) leak."""
    why = ("after a preemption its beams each need their own copy, and they do not fit even an "
           "empty cache" if beams else "it does not fit even an empty cache")
    return ApiError(400, f"the server's KV cache cannot hold this request: {why}; a smaller "
                         f"{param} fits", param)


def request_failed() -> ApiError:
    """A request the engine failed alone (its forward or sampling kept failing while the
    others' did not): an internal error of that request only, the other requests went on."""
    return ApiError(500, "internal error in this request only (the engine failed it and went on "
                         "with the others); the server log has the details")


def rejected_running(message: str, param: Optional[str]) -> ApiError:
    """400 naming ``param``: the engine failed this request alone, in a step, with a
    RequestRejectedError: its own parameters cannot be computed exactly (every processed score
    -inf: a huge repetition_penalty); the engine's message names the field to change too, the
    others went on."""
    return ApiError(400, f"this request cannot be computed (it failed alone; other requests are "
                         f"unaffected): {message}", param)
