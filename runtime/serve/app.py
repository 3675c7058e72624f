"""The OpenAI-compatible HTTP API (FastAPI) over an EngineThread.

    POST /v1/completions        a prompt (text or token ids) or a list of them; max_tokens,
                                sampling and penalty fields, stop, logprobs, echo, stream (SSE)
    POST /v1/chat/completions   messages through the model's chat template; the same fields,
                                max_completion_tokens, logprobs / top_logprobs, delta chunks
    GET  /v1/models             the served model, and each LoRA adapter (its ``parent``)
    GET  /v1/models/{model}     one of them (the client's ``models.retrieve``); 404 naming an
                                id not served
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text, vLLM's names under "vmemkv:"
    POST /sleep, /wake_up, /resize, /reset_prefix_cache, GET /is_sleeping
                                vLLM's elastic-memory routes, on the engine thread (admin.py)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                                adapters at run time, inside --lora-root (lora_routes.py)

A request's ``model`` is the served model's id or a loaded adapter's name (its requests run
with that adapter).

Every error is OpenAI's JSON shape (``errors.ApiError``): 400 naming the field, 404/405 for a
wrong path or method, 409 for a resize or sleep the engine refuses, 503 with Retry-After when
the queue is full, the engine is asleep or the server is shutting down, 429 with Retry-After
when the client's API key has its --max-requests-per-key in flight, 500 with no traceback
(the traceback goes to the server log). A client that disconnects aborts its requests; a
shutdown past its drain ends them (shutdown.py).

A request's part of the server's response budget (``submission.ResponseBudget``, 503 +
Retry-After when spent) is given back once its response is out: after its last body message
the connection's buffer has drained below its low-water mark (``send`` waits on it), or the
connection is gone (``--send-timeout`` drops one whose client stopped reading: server.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from . import protocol
from .admin import add_admin_routes
from .lora_routes import add_lora_routes
from .auth import KEY_SCOPE_KEY, salted
from .chat import ChatFormat, chat_token_ids, parse_chat_request
from .completions import CompletionFormat, ServedModel, prompt_token_ids
from .engine_thread import EngineThread
from .errors import ApiError, internal_error
from .limits import ResponseBounds
from .metrics import CONTENT_TYPE, ServeMetrics
from .shutdown import Drain, shutting_down
from .submission import Submission

log = logging.getLogger("vmemkv.serve")
HELD_SCOPE_KEY = "vmemkv.held_responses"   # the request's budget Reservations (_ReleaseWhenSent)


def create_app(server: EngineThread, metrics: ServeMetrics, served: ServedModel,
               drain: Optional[Drain] = None, lora_root=None) -> FastAPI:
    """The app; the caller starts and stops ``server`` (``serve.run_server`` does both).
    ``drain``: the shutdown's (shutdown.py); auth and body limits wrap the app (auth.Guard).
    ``lora_root``: the folder runtime adapter loading may read (None: off; lora_routes.py)."""
    drain = drain or Drain()
    bounds = ResponseBounds.of(served.tokenizer, served.vocab_size)   # its tokens' JSON bytes
    app = FastAPI(title="vmemkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_ReleaseWhenSent)
    _error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if not server.alive:
            return _error(ApiError(503, "the engine thread is not running"))
        return Response(status_code=200)

    def model_objects() -> list:
        """The served model, then each adapter loaded as this reads (adapter_limits: one
        the engine thread unloads meanwhile is left out)."""
        base = {"object": "model", "created": created, "owned_by": "vmemkv"}
        return [{"id": served.name, **base, "max_model_len": served.model_limit()}] + [
            {"id": name, **base, "max_model_len": limit, "parent": served.name}
            for name, limit in served.adapter_limits().items()]

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": model_objects()}

    @app.get("/v1/models/{model_id:path}")     # ":path": an id may hold "/" (org/name)
    async def model(model_id: str) -> Response:
        found = next((m for m in model_objects() if m["id"] == model_id), None)
        if found is None:
            return _error(served.not_served(model_id))
        return JSONResponse(found)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, "/v1/completions", drain,
                             lambda: _complete(request, server, served, drain, bounds))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, "/v1/chat/completions", drain,
                             lambda: _chat(request, server, served, drain, bounds))

    add_admin_routes(app, server)
    add_lora_routes(app, server, lora_root, served.name)
    return app


async def _answer(request: Request, path: str, drain: Drain, work) -> Response:
    if drain.draining:
        return _error(shutting_down())
    try:
        return await work()
    except ApiError as error:
        return _error(error)
    except Exception:   # noqa: BLE001 -- a 500 shows no traceback; the log has it
        log.exception("POST %s failed", path)
        return _error(internal_error())


async def _complete(request: Request, server: EngineThread, served: ServedModel,
                    drain: Drain, bounds: ResponseBounds) -> Response:
    arrival_s, created_s = time.perf_counter(), int(time.time())
    req = salted(await asyncio.to_thread(protocol.parse_completion_request, await request.body()),
                 request.scope)                                     # parsed off the event loop
    batch = await asyncio.to_thread(prompt_token_ids, req, served)   # off the event loop
    params = served.engine_params(req.sampling_params(), req.model)
    submission = _held(request, Submission(server, batch, params, arrival_s, "cmpl",
                                           served.tokenizer is not None, stream=req.stream,
                                           echo=req.echo,    # the limit counts the echo
                                           bound=bounds.completion,
                                           model_id=req.model or served.name,
                                           width_param=req.width_param,
                                           key=request.scope.get(KEY_SCOPE_KEY)))
    fmt = CompletionFormat(req, served, req.prompts(), batch, submission)
    return await _respond(request, submission, fmt, (req.model or served.name, created_s), req,
                          drain)


async def _chat(request: Request, server: EngineThread, served: ServedModel,
                drain: Drain, bounds: ResponseBounds) -> Response:
    arrival_s, created_s = time.perf_counter(), int(time.time())
    req = salted(await asyncio.to_thread(parse_chat_request, await request.body()),
                 request.scope)
    ids, max_tokens = await asyncio.to_thread(chat_token_ids, req, served)   # off the loop
    params = served.engine_params(req.sampling_params(max_tokens), req.model)
    submission = _held(request, Submission(server, [ids], params, arrival_s, "chatcmpl", True,
                                           stream=req.stream, max_param=req.max_param,
                                           bound=bounds.chat, model_id=req.model or served.name,
                                           width_param=req.width_param,
                                           key=request.scope.get(KEY_SCOPE_KEY)))
    return await _respond(request, submission, ChatFormat(req, served, submission),
                          (req.model or served.name, created_s), req, drain)


def _held(request: Request, submission: Submission) -> Submission:
    """``submission``, its budget Reservation given back when its response is out."""
    if submission.reservation is not None:
        request.scope[HELD_SCOPE_KEY].append(submission.reservation)
    return submission


class _ReleaseWhenSent:
    """ASGI middleware: the Reservations a request took (``HELD_SCOPE_KEY``) are released
    when its exchange is over. Its last body message goes as two: the body, then an empty
    last one, which the server's ``send`` holds until the connection's buffer has drained
    (uvicorn waits on its flow control) or the connection is gone."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = scope[HELD_SCOPE_KEY] = []

        async def sending(message) -> None:
            if held and message["type"] == "http.response.body" \
                    and not message.get("more_body", False):
                await send({**message, "more_body": True})
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            for reservation in held:
                reservation.release()


async def _respond(request: Request, submission: Submission, fmt, stamp: Tuple[str, int], req,
                   drain: Drain) -> Response:
    """``stamp``: (the model named in every envelope, the Unix time the request was accepted:
    its ``created``, the same in every chunk)."""
    try:
        await submission.started()
    except asyncio.CancelledError:
        submission.close()
        raise
    if req.stream:
        return StreamingResponse(_stream(submission, fmt, stamp, req.include_usage, drain),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _collect(request, submission, fmt, stamp, drain)


async def _stream(submission: Submission, fmt, stamp: Tuple[str, int], include_usage: bool,
                  drain: Drain) -> AsyncIterator[str]:
    """SSE chunks, one per token; ``[DONE]`` last. A disconnect cancels this generator, which
    aborts the requests; a shutdown past its drain ends it with an error event."""
    kind = fmt.kind + ".chunk" if fmt.kind != "text_completion" else fmt.kind
    try:
        first = fmt.first_chunks()
        if first:
            yield protocol.sse(protocol.envelope(submission.id, kind, *stamp, first))
        async for delta in drain.guard(submission.events()):
            yield protocol.sse(protocol.envelope(submission.id, kind, *stamp, [fmt.chunk(delta)]))
        if include_usage:
            yield protocol.sse(protocol.envelope(submission.id, kind, *stamp, [], protocol.usage(
                submission.prompt_tokens, submission.completion_tokens)))
    except ApiError as error:   # the status line is gone: the error travels as an event
        yield protocol.sse(error.body())
    finally:
        submission.close()
    yield protocol.sse("[DONE]")


async def _collect(request: Request, submission: Submission, fmt, stamp: Tuple[str, int],
                   drain: Drain) -> Response:
    """Wait for every choice; a client that disconnects first aborts the requests, a shutdown
    past its drain answers 503."""
    async def consume() -> None:
        async for _ in submission.events():
            pass

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request))
    expired = asyncio.ensure_future(drain.expired.wait())
    try:
        await asyncio.wait({work, gone, expired}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        expired.cancel()
        if not work.done():   # the client left, or the shutdown's drain is over
            work.cancel()
            submission.close()
    if not work.done() and drain.expired.is_set():
        drain.cut += 1
        return _error(shutting_down())
    if not work.done():
        return Response(status_code=499)   # nobody reads it; nginx's "client closed request"
    work.result()   # raises the ApiError of a failed request
    choices = [fmt.choice(c) for c in submission.choices]
    return JSONResponse(protocol.envelope(submission.id, fmt.kind, *stamp, choices, protocol.usage(
        submission.prompt_tokens, submission.completion_tokens)))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(ApiError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(internal_error())
