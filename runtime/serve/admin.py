"""vLLM's elastic-memory routes: put the engine to sleep (its KV-cache memory back to the
device), wake it, resize its cache. Each runs on the engine thread between two steps
(``EngineThread.call``); the handler awaits the result.

    POST /sleep        {"level": 1} or no body   -> {"is_sleeping": true, "released_bytes": N}
                       (or vLLM's ?level=1)
    POST /wake_up      {} or no body             -> {"is_sleeping": false, "cache_bytes": N}
                       (or vLLM's ?tags=kv_cache, with or without tags=weights)
    GET  /is_sleeping                            -> {"is_sleeping": bool}
    POST /resize       {"cache_bytes": N} or {"memory_utilization": F}, "preempt": bool
                                                 -> {"cache_bytes": N}
    POST /reset_prefix_cache  {} or no body      -> {"evicted_tokens": N}
                       (every cached prefix no request in flight holds: a benchmark's cold
                       start; an operator route, as a tenant could slow every other one)

Bodies are parsed as strictly as the completions request (a 400 naming the field: a wrong
type, an unknown field, both or neither of ``cache_bytes`` and ``memory_utilization``). What the
engine cannot do (``CacheResizeError``: bytes running requests hold without ``preempt``, past
``max_cache_bytes``, a paged cache, the device's available memory) is a 409 naming the reason,
with nothing changed: the request was well formed, the engine's state refuses it. Level 1 is
all there is: only the KV cache's memory is given back; the weights stay. vLLM's clients send
``level`` and ``tags`` in the query string: they are checked as strictly as a body (a level
other than 1, tags that leave the KV cache asleep, any other query parameter, on /resize any
at all: a 400 naming it, nothing run), never ignored (``?level=2`` had put the engine to sleep
at level 1, answering 200).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from vmemkv.runtime.errors import CacheConfigError
from vmemkv.scheduler.errors import CacheResizeError

from .engine_thread import EngineThread
from .errors import ApiError
from .protocol import parse_model


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    level: int = 1    # vLLM's: 1 gives the KV cache back (2 would drop the weights: not here)


class WakeUpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResetPrefixCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResizeRequest(BaseModel):
    """One of ``cache_bytes`` (bytes, rounded down to what whole pages hold) and
    ``memory_utilization`` (that fraction of the device's available memory plus what the cache
    uses now)."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    cache_bytes: Optional[int] = Field(None, ge=0)
    memory_utilization: Optional[float] = Field(None, gt=0.0, le=1.0)
    preempt: bool = False   # shrinking below what running requests hold preempts the newest

    @property
    def field(self) -> str:
        return "cache_bytes" if self.cache_bytes is not None else "memory_utilization"


WAKE_TAGS = ("weights", "kv_cache")   # vLLM's wake_up tags; only the KV cache sleeps here


def parse_sleep(body: bytes, query=None) -> SleepRequest:
    """The body's SleepRequest, its level checked, and the query string's (``query``: a
    request's ``query_params``; None: none)."""
    request = _parse(body, SleepRequest)
    levels = [request.level] + _query_values(query, "level", ("level",))
    odd = next((level for level in levels if level not in (1, "1")), None)
    if odd is not None:
        raise ApiError(400, f"level: only level 1 is supported (the KV cache's memory is given "
                            f"back, the weights stay), got {odd!r}", "level")
    return request


def parse_wake_up(body: bytes, query=None) -> WakeUpRequest:
    """The body's WakeUpRequest; vLLM's ``tags`` in the query string must wake the KV cache,
    all that sleeps here (``tags=weights`` alone would leave it asleep)."""
    request = _parse(body, WakeUpRequest)
    tags = _query_values(query, "tags", ("tags",))
    if tags and ("kv_cache" not in tags or not set(tags) <= set(WAKE_TAGS)):
        raise ApiError(400, f"tags: only the KV cache sleeps here (the weights stay), and a "
                            f"wake-up wakes it: send no tags or tags=kv_cache (with or without "
                            f"tags=weights), got {tags}", "tags")
    return request


def _query_values(query, name: str, allowed: tuple) -> list:
    """The values of query parameter ``name``; ApiError 400 naming any parameter not in
    ``allowed`` (a query string is checked as a body is: nothing is ignored)."""
    if query is None:
        return []
    unknown = next((key for key in query.keys() if key not in allowed), None)
    if unknown is not None:
        takes = ", ".join(allowed) if allowed else "no query parameters (send a JSON body)"
        raise ApiError(400, f"unknown query parameter {unknown[:40]!r}; this route takes "
                            f"{takes}", unknown[:40])
    return query.getlist(name) if name else []


def parse_resize(body: bytes) -> ResizeRequest:
    request = parse_model(body, ResizeRequest)
    if request.cache_bytes is None and request.memory_utilization is None:
        raise ApiError(400, "cache_bytes (bytes) or memory_utilization (a fraction in (0, 1]) "
                            "is required", "cache_bytes")
    if request.cache_bytes is not None and request.memory_utilization is not None:
        raise ApiError(400, "memory_utilization: give one of cache_bytes and memory_utilization, "
                            "not both", "memory_utilization")
    return request


def _parse(body: bytes, model):
    """An empty body is the defaults (vLLM's clients POST these routes without one)."""
    return model() if not body.strip() else parse_model(body, model)


def add_admin_routes(app: FastAPI, server: EngineThread) -> None:
    """The routes above on ``app``; they raise ApiError, which the app answers."""

    @app.post("/sleep")
    async def sleep(request: Request) -> dict:
        parse_sleep(await request.body(), request.query_params)
        released = await _on_engine(server.sleep())
        return {"is_sleeping": True, "released_bytes": released}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        parse_wake_up(await request.body(), request.query_params)
        cache_bytes = await _on_engine(server.wake_up())
        return {"is_sleeping": False, "cache_bytes": cache_bytes}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": await _on_engine(server.call(lambda engine: engine.is_sleeping))}

    @app.post("/resize")
    async def resize(request: Request) -> dict:
        _query_values(request.query_params, "", ())
        req = parse_resize(await request.body())

        def work(engine) -> int:
            if engine.is_sleeping:
                raise CacheResizeError("the engine is asleep (POST /sleep): POST /wake_up first")
            return engine.resize_cache(req.cache_bytes, memory_utilization=req.memory_utilization,
                                       preempt=req.preempt)
        return {"cache_bytes": await _on_engine(server.call(work), req.field)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        _query_values(request.query_params, "", ())
        _parse(await request.body(), ResetPrefixCacheRequest)
        evicted = await _on_engine(server.call(lambda engine: engine.reset_prefix_cache()))
        return {"evicted_tokens": evicted}


async def _on_engine(future, param: Optional[str] = None):
    """What the engine thread's ``future`` gives; what the engine refuses is a 409."""
    try:
        return await asyncio.wrap_future(future)
    except (CacheResizeError, CacheConfigError) as error:   # the engine's words, the API's names
        message = str(error).replace("preempt=True", '"preempt": true')
        raise ApiError(409, message, param) from None
