"""The requests in flight (submitted to the engine thread and not yet ended), in all and per API
key: ``--max-queue`` bounds the backlog, ``--max-requests-per-key`` each key's share of it, so
that one tenant cannot take every slot and leave the others a 503 until it lets go.

One owner for both counts: ``take`` counts a request in both or in neither, ``give_back`` frees
both together, on the one path that ends a queued request (EngineThread: finished, aborted, a
client gone, failed, refused by the engine, or ended by the server stopping), so they cannot
drift apart. A request counts once whatever its ``n`` or beam width; each prompt of a batched
completion counts one. A request without a key (the server has no API keys) counts in the total
only; ``check_max_requests_per_key`` refuses a cap without keys, and a cap that is not below
each bound of the whole server's requests in flight (``--max-queue``; ``--max-connections``:
each HTTP request in flight holds a connection): at that bound one key could still take it all.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

from .errors import ApiError, KeyAtLimitError, ServeConfigError, ServerOverloadedError

log = logging.getLogger("vmemkv.serve")


def check_max_requests_per_key(max_requests_per_key, api_keys, max_queue: Optional[int] = None,
                               max_connections: Optional[int] = None) -> None:
    """ServeConfigError unless ``max_requests_per_key`` is None or an int >= 1 on a server with
    API keys (``api_keys``): without keys every client would be the same one; and below
    ``max_queue`` and ``max_connections`` where given (``check_key_share``)."""
    if max_requests_per_key is None:
        return
    if isinstance(max_requests_per_key, bool) or not isinstance(max_requests_per_key, int) \
            or max_requests_per_key < 1:
        raise ServeConfigError(f"max_requests_per_key (--max-requests-per-key) must be an int "
                               f">= 1, got {max_requests_per_key!r}")
    if not api_keys:
        raise ServeConfigError("--max-requests-per-key needs API keys (--api-key or "
                               "VMEMKV_API_KEY): it caps each key's requests in flight, and "
                               "without keys every client is the same one")
    check_key_share(max_requests_per_key, max_queue, max_connections)


def check_key_share(max_requests_per_key: int, max_queue: Optional[int] = None,
                    max_connections: Optional[int] = None) -> None:
    """ServeConfigError naming both flags when the per-key cap is not below ``max_queue``
    (the requests in flight in all) or ``max_connections`` (each HTTP request in flight holds
    one): at that bound one key could still fill it, and every other key got 503 until it let
    go, which the cap exists to prevent. None: that bound is not checked."""
    for bound, flag, what in ((max_queue, "--max-queue", "slot of the queue"),
                              (max_connections, "--max-connections", "connection")):
        if bound is not None and max_requests_per_key >= bound:
            raise ServeConfigError(
                f"--max-requests-per-key {max_requests_per_key} must be less than {flag} "
                f"{bound}: at {bound} or more one API key can still take every {what}, and "
                f"every other key gets 503 until it lets go; lower --max-requests-per-key (K keys "
                f"each keep their share when K x --max-requests-per-key <= {flag}) or raise "
                f"{flag}")


class RequestsInFlight:
    """At most ``max_requests`` requests in flight, and ``max_per_key`` (None: no cap) of any
    one API key (ServeConfigError unless below ``max_requests``). Thread-safe: taken on the
    event loop, given back on the engine thread. A refusal takes nothing; a key's refusal names
    its own count only, never another key's."""

    def __init__(self, max_requests: int, max_per_key: Optional[int] = None) -> None:
        if max_per_key is not None:          # ServeConfigError at or past the total
            check_key_share(max_per_key, max_queue=max_requests)
        self.max_requests, self.max_per_key = max_requests, max_per_key
        self._lock = threading.Lock()
        self._total = 0
        self._per_key: Dict[str, int] = {}     # keys with requests in flight only

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def of_key(self, key: str) -> int:
        """Requests of ``key`` taken and not yet given back."""
        with self._lock:
            return self._per_key.get(key, 0)

    def key_share_bytes(self, budget_bytes: int, max_response_bytes: int) -> Optional[int]:
        """The bytes of a ``budget_bytes`` response budget one key may hold: the share its
        requests have of the queue (``max_per_key / max_requests``), never under
        ``max_response_bytes`` (a response the limit takes must fit a key alone: a 429 it could
        never pass would be retried for good); None without a per-key cap."""
        if self.max_per_key is None:
            return None
        return max(max_response_bytes, budget_bytes * self.max_per_key // self.max_requests)

    def check_key_room(self, key: Optional[str], count: int) -> None:
        """ApiError 400 naming ``prompt`` when ``count`` requests (one HTTP request's prompts)
        pass ``max_per_key`` even alone (a 429 would be retried forever), KeyAtLimitError (429)
        when they pass it beside ``key``'s requests in flight; nothing is taken."""
        with self._lock:
            self._check_key_room(key, count)

    def take(self, key: Optional[str]) -> None:
        """Count one more request (of ``key``), or KeyAtLimitError / ServerOverloadedError with
        nothing taken (the key's share is checked first: it is the client's own doing)."""
        with self._lock:
            self._check_key_room(key, 1)
            if self._total >= self.max_requests:
                raise ServerOverloadedError(self.max_requests)
            self._total += 1
            if key is not None:
                self._per_key[key] = self._per_key.get(key, 0) + 1

    def give_back(self, key: Optional[str]) -> None:
        """One request (of ``key``) has ended."""
        with self._lock:
            assert self._total > 0, "a request given back that was never taken"
            self._total -= 1
            if key is None:
                return
            left = self._per_key.pop(key) - 1
            if left:
                self._per_key[key] = left

    def _check_key_room(self, key: Optional[str], count: int) -> None:
        cap = self.max_per_key
        if key is None or cap is None:
            return
        if count > cap:
            raise ApiError(400, f"prompt: {count} prompts, but this server takes at most {cap} "
                                f"requests in flight per API key (--max-requests-per-key); send "
                                f"fewer at a time", "prompt")
        in_flight = self._per_key.get(key, 0)
        if in_flight + count > cap:
            log.info("refused %d request(s) of an API key with %d of its %d in flight "
                     "(--max-requests-per-key)", count, in_flight, cap)
            raise KeyAtLimitError(in_flight, count, cap)
