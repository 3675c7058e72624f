"""httpx's one-shot calls for the suite's servers, which speak plain HTTP on 127.0.0.1.

``httpx.get``, ``post``, ``stream`` and ``request`` build a TLS context for every call, loading
certifi's bundle (~25 ms of CPU each) though no request here can use it: about 330 calls spent
8 s of the suite's CPU on it. These are the same calls with ``verify=False`` (no bundle loaded;
nothing else changes: each call still opens and closes its own connection)."""
from __future__ import annotations

import functools

import httpx

get = functools.partial(httpx.get, verify=False)
post = functools.partial(httpx.post, verify=False)
stream = functools.partial(httpx.stream, verify=False)
request = functools.partial(httpx.request, verify=False)
