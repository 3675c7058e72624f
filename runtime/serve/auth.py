"""Who may call the server, and what a request must look like before anything reads its body.

``Guard`` wraps the app (pure ASGI, outside FastAPI), in this order:

    1. Bearer auth    with API keys (``--api-key``, repeatable, or ``VMEMKV_API_KEY``, comma
                      separated) every route but ``/health`` needs ``Authorization: Bearer KEY``
                      (401 otherwise); ``/metrics`` needs ``--metrics-key`` when one is set (else
                      an API key). Keys are compared in constant time (``hmac.compare_digest``,
                      every key every time).
    2. Content-Type   a POST must say ``application/json`` (415 otherwise): a browser's simple
                      ``text/plain`` request from a foreign page (cross-site request forgery,
                      DNS rebinding) never reaches the engine.
    3. body limits    a Content-Length over the limit is 413 before a byte is read; the rest is
                      ``limits.BodyLimits`` around ``receive``.

With ``salt_per_key`` each key's requests get a prefix-cache salt derived from the key
(``SALT_SCOPE_KEY`` in the ASGI scope, combined with the request's own ``cache_salt`` by
``salted``), so tenants never share cached prefixes: no timing side channel between them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .errors import ApiError, ServeConfigError
from .limits import BodyLimits, ServeLimits, client_name, too_large

log = logging.getLogger("vmemkv.serve")

API_KEY_ENV, METRICS_KEY_ENV = "VMEMKV_API_KEY", "VMEMKV_METRICS_KEY"
SALT_SCOPE_KEY = "vmemkv.key_salt"
OPEN_PATHS = ("/health",)


@dataclass(frozen=True)
class AuthConfig:
    """API keys (none: no auth), the metrics key (None: /metrics takes an API key, or nothing
    without keys) and whether each key gets its own prefix-cache salt."""
    api_keys: Tuple[str, ...] = ()
    metrics_key: Optional[str] = None
    salt_per_key: bool = False

    def __post_init__(self) -> None:
        for name, key in [("api key", k) for k in self.api_keys] + [("metrics key", self.metrics_key)]:
            if key is not None and (not isinstance(key, str) or not key.isprintable()
                                    or not key or any(c.isspace() for c in key)):
                raise ServeConfigError(f"an {name} must be a non-empty string without spaces")
        if self.salt_per_key and not self.api_keys:
            raise ServeConfigError("--salt-per-key needs API keys (--api-key or VMEMKV_API_KEY)")

    @classmethod
    def of(cls, api_keys: Sequence[str] = (), metrics_key: Optional[str] = None,
           salt_per_key: bool = False, environ=os.environ) -> "AuthConfig":
        """Flags first, the environment added (``VMEMKV_API_KEY`` may list keys, commas)."""
        keys = list(api_keys) + [k for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
        return cls(tuple(k.strip() for k in keys), metrics_key or environ.get(METRICS_KEY_ENV)
                   or None, salt_per_key)

    def key_for(self, path: str, authorization: str) -> Tuple[bool, Optional[str]]:
        """(allowed, the API key that matched) for a request to ``path``."""
        if path in OPEN_PATHS:
            return True, None
        wanted = (self.metrics_key,) if path == "/metrics" and self.metrics_key else self.api_keys
        if not wanted:
            return True, None
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        matched = None
        for key in wanted:                  # every key, every time: no early exit to time
            if hmac.compare_digest(token.encode(), key.encode()):
                matched = key
        return matched is not None, matched


def key_salt(key: str) -> str:
    """The prefix-cache salt of one API key (never sent to anyone)."""
    return hashlib.sha256(b"vmemkv-key-salt:" + key.encode()).hexdigest()[:32]


def salted(request, scope):
    """``request`` (a protocol request) with its key's salt in front of its own cache_salt."""
    salt = scope.get(SALT_SCOPE_KEY)
    if salt is None:
        return request
    own = request.cache_salt or ""
    return request.model_copy(update={"cache_salt": f"key:{salt}|{own}"})


class Guard:
    """The ASGI app ``app`` behind the rules in the module docstring."""

    def __init__(self, app, limits: ServeLimits, auth: AuthConfig) -> None:
        self.app, self.limits, self.auth = app, limits, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check(scope, headers)
        except ApiError as refusal:
            await send_error(send, refusal)
            return
        await self.app(scope, BodyLimits(receive, scope, self.limits), send)

    def _check(self, scope, headers: dict) -> None:
        allowed, key = self.auth.key_for(scope["path"], headers.get("authorization", ""))
        if not allowed:
            log.info("refused %s: %s %s without a valid API key", client_name(scope),
                     scope["method"], scope["path"])
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           headers={"WWW-Authenticate": "Bearer"})
        if key is not None and self.auth.salt_per_key:
            scope[SALT_SCOPE_KEY] = key_salt(key)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise ApiError(415, f"Content-Type must be application/json, got "
                                    f"{kind or 'none'!r}")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, f"Content-Length {length[:40]!r} is not a byte count")
            if int(length) > self.limits.max_body_bytes:
                log.warning("refused %s: Content-Length %s over %d bytes", client_name(scope),
                            length, self.limits.max_body_bytes)
                raise too_large(self.limits)


async def send_error(send, error: ApiError) -> None:
    """``error`` as the whole response; the connection closes after it (a body the client may
    still be sending is never read)."""
    body = json.dumps(error.body()).encode()
    extra = {k.lower(): v for k, v in error.headers.items()}
    extra["connection"] = "close"
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
