"""Who may call the server, and what a request must look like before anything reads its body.

``Guard`` wraps the app (pure ASGI, outside FastAPI), in this order:

    1. Bearer auth    with API keys (``--api-key``, repeatable, or ``VMEMKV_API_KEY``, comma
                      separated) every route but ``/health`` needs ``Authorization: Bearer KEY``
                      (401 otherwise); ``/metrics`` needs ``--metrics-key`` when one is set (else
                      an API key; with ``--salt-per-key`` the admin key, never a tenant's: it
                      counts every tenant's tokens and prefix hits, so a tenant's key is 403);
                      the operator routes (``ADMIN_PATHS``: sleep, wake, resize, reset
                      the prefix cache, load and unload adapters) need ``--admin-key`` when one is set, else an
                      API key, but never a tenant's: with ``--salt-per-key`` (each key a tenant)
                      and no admin key they answer 403. Keys are visible ASCII (what an HTTP
                      header carries) compared in constant time (``hmac.compare_digest``, every
                      key every time).
    2. Content-Type   a POST must say ``application/json``, uncompressed (415 otherwise, naming
                      the Content-Type or Content-Encoding): a browser's simple
                      ``text/plain`` request from a foreign page (cross-site request forgery,
                      DNS rebinding) never reaches the engine.
    3. body limits    a Content-Length over the limit is 413 before a byte is read; the rest is
                      ``limits.BodyLimits`` around ``receive``.

The API key that opened a request goes in the ASGI scope (``KEY_SCOPE_KEY``): the app counts its
requests in flight against it (``--max-requests-per-key``: in_flight.py).

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

API_KEY_ENV, METRICS_KEY_ENV, ADMIN_KEY_ENV = "VMEMKV_API_KEY", "VMEMKV_METRICS_KEY", "VMEMKV_ADMIN_KEY"
SALT_SCOPE_KEY = "vmemkv.key_salt"
KEY_SCOPE_KEY = "vmemkv.api_key"     # the API key that opened the request (never sent anywhere)
OPEN_PATHS = ("/health",)
# routes that change the server for every client: an operator's, never a tenant's
ADMIN_PATHS = ("/sleep", "/wake_up", "/resize", "/reset_prefix_cache", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter")


@dataclass(frozen=True)
class AuthConfig:
    """API keys (none: no auth), the metrics key (None: /metrics takes an API key, or nothing
    without keys; with ``salt_per_key`` the admin key, or none), the admin key (None: the
    operator routes take an API key, none with ``salt_per_key``) and whether each key gets its
    own prefix-cache salt."""
    api_keys: Tuple[str, ...] = ()
    metrics_key: Optional[str] = None
    salt_per_key: bool = False
    admin_key: Optional[str] = None

    def __post_init__(self) -> None:
        for name, key in ([("--api-key", k) for k in self.api_keys]
                          + [("--metrics-key", self.metrics_key), ("--admin-key", self.admin_key)]):
            if key is not None and (not isinstance(key, str) or not key
                                    or not all(33 <= ord(c) <= 126 for c in key)):
                # the key itself is never shown: it may be a real one with a typo
                raise ServeConfigError(f"{name}: a key must be a non-empty string of visible "
                                       f"ASCII characters (no spaces; an HTTP header carries "
                                       f"nothing else, so no client could send it)")
        if self.salt_per_key and not self.api_keys:
            raise ServeConfigError("--salt-per-key needs API keys (--api-key or VMEMKV_API_KEY)")
        for name, key in (("--admin-key", self.admin_key), ("--metrics-key", self.metrics_key)):
            if self.salt_per_key and key is not None and key in self.api_keys:   # a tenant's
                raise ServeConfigError(f"{name} is also an API key: with --salt-per-key each API "
                                       f"key is a tenant's, and {name} opens what no tenant may")

    @classmethod
    def of(cls, api_keys: Sequence[str] = (), metrics_key: Optional[str] = None,
           salt_per_key: bool = False, environ=os.environ,
           admin_key: Optional[str] = None) -> "AuthConfig":
        """Flags first, the environment added (``VMEMKV_API_KEY`` may list keys, commas)."""
        keys = list(api_keys) + [k for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
        # a flag given empty is refused (AuthConfig); an empty variable counts as unset
        return cls(tuple(k.strip() for k in keys),
                   metrics_key if metrics_key is not None else environ.get(METRICS_KEY_ENV) or None,
                   salt_per_key,
                   admin_key if admin_key is not None else environ.get(ADMIN_KEY_ENV) or None)

    def wanted(self, path: str) -> Tuple[Optional[Tuple[str, ...]], str]:
        """(the keys ``path`` takes: () when it is open, None when no key opens it, and their
        name for a refusal)."""
        if path in OPEN_PATHS:
            return (), ""
        if path == "/metrics" and self.metrics_key:
            return (self.metrics_key,), "the metrics key (--metrics-key)"
        if path == "/metrics" and self.salt_per_key:
            return ((self.admin_key,) if self.admin_key else None), \
                "the metrics key (--metrics-key) or the admin key (--admin-key)"
        if path in ADMIN_PATHS:
            if self.admin_key:
                return (self.admin_key,), "the admin key (--admin-key)"
            if self.salt_per_key:
                return None, "the admin key (--admin-key): with --salt-per-key each API key is a tenant's"
        return self.api_keys, "a valid API key"

    def closed_to_tenants(self, path: str) -> bool:
        """Whether ``path`` tells one tenant about the others, so that with ``salt_per_key`` no
        API key (each a tenant's) opens it: /metrics without a metrics key."""
        return self.salt_per_key and path == "/metrics" and not self.metrics_key

    def key_for(self, path: str, authorization: str) -> Tuple[bool, Optional[str]]:
        """(allowed, the API key that matched) for a request to ``path``."""
        wanted, _ = self.wanted(path)
        if wanted is None:
            return False, None
        if not wanted:
            return True, None
        matched = _matching(authorization, wanted)
        return matched is not None, matched

    def is_api_key(self, authorization: str) -> bool:
        return _matching(authorization, self.api_keys) is not None


def _matching(authorization: str, keys: Sequence[str]) -> Optional[str]:
    """The key of ``keys`` an Authorization header's bearer token is, else None."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    matched = None
    for key in keys:                        # every key, every time: no early exit to time
        if hmac.compare_digest(token.encode(), key.encode()):
            matched = key
    return matched


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
        path, authorization = scope["path"], headers.get("authorization", "")
        allowed, key = self.auth.key_for(path, authorization)
        if not allowed:
            wanted, who = self.auth.wanted(path)
            log.info("refused %s: %s %s without %s", client_name(scope), scope["method"],
                     path, who)
            if self.auth.closed_to_tenants(path) and (wanted is None
                                                      or self.auth.is_api_key(authorization)):
                raise ApiError(403, f"{path} counts every tenant's tokens and prefix-cache hits; "
                                    f"with --salt-per-key (each API key a tenant's) it is open "
                                    f"only with {who}, never an API key"
                                    + ("" if wanted else " (neither is set on this server)"))
            if wanted is None:
                raise ApiError(403, f"{path} changes the server for every client; it "
                                    f"is open only with {who} (not set on this server)")
            raise ApiError(401, f"{path} needs {who}: Authorization: Bearer KEY",
                           headers={"WWW-Authenticate": "Bearer"})
        if key is not None:
            scope[KEY_SCOPE_KEY] = key
            if self.auth.salt_per_key:
                scope[SALT_SCOPE_KEY] = key_salt(key)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":   # no header is not the type "none" sent
                raise ApiError(415, "Content-Type must be application/json, got " + (
                    repr(kind) if kind else "no Content-Type header"))
            coding = headers.get("content-encoding", "identity").strip().lower()
            if coding != "identity":         # a gzip body read as JSON: a baffling 400
                raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported: send "
                                    f"the JSON body uncompressed")
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
