"""The engine requests of one HTTP request, on the HTTP side: submitted together (one per prompt,
``n`` choices each), their events carried from the engine thread to the event loop, and each
choice's text, token ids and logprobs assembled.

Choice ``prompt * n + sample`` is sample ``sample`` of prompt ``prompt`` (OpenAI's order). The
text is the engine's (``TokenEvent.text``: incremental detokenization and stop strings, the
same as ``Engine.generate``'s); without a tokenizer it is the token ids in decimal, space-
separated. A submission that leaves early (the client disconnected) aborts every request still
live on the engine thread, which releases its memory before the next step. One answered with an
error (a prompt refused or failed; the queue full part-way, which ``started`` raises) raises it
once the requests it aborted have ended there: the client that has the error finds them gone
(/metrics, ``--max-queue``).

Before anything is queued, the response's worst case (``limits.check_response_bytes``: prompts x
choices x max_tokens, plus each choice's echoed prompt with ``echo``, with or without logprobs)
is checked against the server's ``max_response_bytes``: past it, ApiError 400 naming the field
to lower. Each token, an echoed prompt token too, counts at the served tokenizer's bound
(``bound``: ``limits.ResponseBounds``, from its longest token; its text, id and logprob entries).
A streamed submission (``stream``) keeps no logprobs in its choices: each token's travel in its
Delta only; its bound counts each token's SSE chunk envelope too (``response_bounds``).

Past that, the server's ``ResponseBudget`` bounds the responses of every request at once: each
reserves its estimate before it is queued (ApiError 503 + Retry-After when the budget is spent:
transient; the message names this request's estimate and the budget, never what the others
hold, which the server's log says) and gives it back only once its response is out or its
connection gone (app.py), as a client that never reads holds its response in the server (a
JSON body in the connection's buffer, a stream's tokens in ``events``' queue) after the engine
has finished it.

With an API ``key`` its prompts are checked against the key's share of the requests in flight
first (``--max-requests-per-key``: in_flight.py), all of them at once: past it, KeyAtLimitError
429 + Retry-After, with nothing reserved or queued (a prompt count past the cap alone: 400).
Then its estimate against the key's share of the response budget (the same share as of the
queue, at least one response at ``max_response_bytes``: ``RequestsInFlight.key_share_bytes``):
past it, KeyBudgetError 429 + Retry-After, nothing reserved: one key within its requests in
flight could hold the whole budget, and every other key got 503 until its clients read.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Dict, List, Optional, Sequence, Union

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import (BeamSearchParamsError, CacheShrunkRequestError,
                                         RequestRejectedError, UnknownAdapterError)
from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.engine.sampling import SamplingParams

from .engine_thread import Ended, EngineThread, Token, choices_per_prompt
from .errors import (ApiError, KeyBudgetError, cache_shrunk, cannot_hold, internal_error,
                     rejected_running, request_failed)
from vmemkv.vmem.host import meminfo_bytes

from .errors import ServeConfigError
from .limits import HELD_BYTES_PER_RESPONSE_BYTE, ResponseSize, TokenBytes, check_response_bytes
from .protocol import beam_message
from .response_bounds import stream_bound
from .shutdown import shutting_down

log = logging.getLogger("vmemkv.serve")
RESPONSES_IN_BUDGET = 4   # the default ResponseBudget: 4 responses at --max-response-bytes


@dataclass
class Choice:
    """One choice as it grows: ``text`` and ``token_ids`` so far, logprobs when asked for (and
    the response is not streamed)."""
    index: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[TokenLogprobs] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None   # vLLM's: the stop string or stop id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Delta:
    """What one token added to choice ``index``."""
    index: int
    text: str
    token_ids: List[int]
    logprobs: List[TokenLogprobs]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None


class Submission:
    """Every engine request of one HTTP request. ``events()`` yields a Delta per token;
    ``close()`` aborts whatever has not ended. ``max_response_bytes`` None: ``server``'s
    (``Server`` sets it from its limits; ``DEFAULT_MAX_RESPONSE_BYTES`` without); ``echo``: each
    choice's text starts with its prompt (completions' ``echo``), which the limit counts;
    ``max_param``: the request field an engine refusal of ``max_new_tokens`` names (chat's
    ``max_completion_tokens`` or ``max_tokens``); ``bound``: the bytes a token may add to this
    response (the served tokenizer's ``ResponseBounds``; None: ``TokenBytes()``, no tokenizer's);
    with ``stream`` each token's SSE chunk envelope more (``response_bounds.stream_bound``:
    ``model_id``, the id each chunk names; None: the longest adapter name's); ``width_param``:
    the request field that set a beam search's width, which an engine refusal of it names;
    ``key``: the client's API key (None: the server has none), each prompt counted against it."""

    def __init__(self, server: EngineThread, prompts: Sequence[Sequence[int]],
                 params: SamplingParams, arrival_s: float, prefix: str = "cmpl",
                 has_tokenizer: bool = True, stream: bool = False,
                 max_response_bytes: Optional[int] = None, echo: bool = False,
                 max_param: str = "max_tokens", bound: Optional[TokenBytes] = None,
                 model_id: Optional[str] = None, width_param: str = "beam_width",
                 key: Optional[str] = None) -> None:
        if max_response_bytes is None:
            max_response_bytes = server.max_response_bytes
        chat, bound = prefix == "chatcmpl", bound or TokenBytes()
        if stream:
            bound = stream_bound(bound, chat, model_id)
        size = response_size(prompts, params, echo, bound)
        check_response_bytes(size, max_response_bytes, chat=chat, max_param=max_param)
        if key is not None:         # every prompt fits the key's share, or none is queued
            server.in_flight.check_key_room(key, len(prompts))
        budget = server.response_budget    # reserved before anything is queued
        self.reservation = None
        if budget is not None:             # a key: within its share of the budget too
            share_bytes = None if key is None else server.in_flight.key_share_bytes(
                budget.total_bytes, max_response_bytes)
            self.reservation = budget.reserve(size.estimate_bytes, key, share_bytes)
        self._keep_logprobs = not stream    # a stream's were sent: holding them is all cost
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.n, self._ids_as_text = choices_per_prompt(params), not has_tokenizer
        self._max_param = max_param     # the engine's max_new_tokens, as the client named it
        self._width_param = width_param   # the field that set a beam search's width
        self._beams = isinstance(params, BeamSearchParams)
        self._too_large_param = width_param if self._beams \
            else max_param          # what a request the cache can never hold should shrink
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.prompt_logprobs: List[Optional[list]] = [None] * len(prompts)   # when asked for
        self._server, self._live, self._prompts = server, len(prompts), len(prompts)
        self._ended = [False] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._futures = []
        self._refused: Optional[ApiError] = None   # full part-way: raised by started()
        try:
            for i, ids in enumerate(prompts):
                sink = (lambda item, i=i: loop.call_soon_threadsafe(self._queue.put_nowait, (i, item)))
                self._futures.append(server.submit(ids, params, sink, arrival_s, index=i, key=key))
        except ApiError as error:   # full (503, 429): what was queued goes again
            if self.reservation is not None:
                self.reservation.release()
            if not self._futures:
                raise
            self._refused = error

    async def started(self) -> None:
        """Wait until the engine has queued every request; ApiError 400 if it refused one (404
        for an adapter unloaded since the request was checked; 503 if the queue was full
        part-way), once the others are aborted."""
        if self._refused is not None:
            await self._aborted()
            raise self._refused
        try:
            for future in self._futures:
                await asyncio.wrap_future(future)
        except CacheShrunkRequestError as error:
            await self._aborted()
            raise cache_shrunk(self._client_message(error)) from None
        except (RequestRejectedError, BeamSearchParamsError) as error:
            await self._aborted()
            if isinstance(error, UnknownAdapterError):   # unloaded since it was checked
                raise ApiError(404, self._client_message(error).replace(
                    "SamplingParams.lora", "model"), "model") from None
            param = self._param_of(error.field)     # (a beam field as the client named it)
            message = beam_message(error, param) if isinstance(error, BeamSearchParamsError) \
                else self._client_message(error)
            raise ApiError(400, message, param) from None

    async def events(self) -> AsyncIterator[Delta]:
        while self._live:
            prompt, item = await self._queue.get()
            if isinstance(item, Ended):
                error = self._end(prompt, item)
                if error is not None:
                    await self._aborted()
                    raise error
                continue
            assert isinstance(item, Token)
            if item.prompt_logprobs is not None:
                self.prompt_logprobs[prompt] = item.prompt_logprobs
            yield self._add(prompt, item.event)

    def _end(self, prompt: int, item: Ended) -> Optional[ApiError]:
        """What the request answers when prompt ``prompt``'s end cuts it short, else None."""
        self._ended[prompt] = True
        self._live -= 1
        mine = self.choices[prompt * self.n:(prompt + 1) * self.n]
        if item.status == "finished" or all(c.finished for c in mine):
            return None
        if item.status == "aborted":   # by the engine thread stopping: the server's end
            return shutting_down()
        cause = item.cause if item.alone else None
        if cause is not None and cause.type == "RequestTooLargeError":
            return cannot_hold(self._too_large_param, beams=self._beams)
        if cause is not None and cause.type == RequestRejectedError.__name__:
            return rejected_running(cause.message, self._param_of(cause.field))
        return request_failed() if item.alone else internal_error()

    def _add(self, prompt: int, event) -> Delta:
        choice = self.choices[prompt * self.n + event.index]
        text = event.text
        if self._ids_as_text:
            text = (" " if choice.token_ids else "") + str(event.token_id)
        choice.text += text
        choice.token_ids.append(event.token_id)
        logprobs = [event.logprobs] if event.logprobs is not None else []
        if self._keep_logprobs:
            choice.logprobs.extend(logprobs)
        choice.finish_reason, choice.stop_reason = event.finish_reason, event.stop_reason
        return Delta(choice.index, text, [event.token_id], logprobs, event.finish_reason,
                     event.stop_reason)

    def close(self) -> None:
        """Abort every request still live (a disconnect, a failed sibling, the server stopping)."""
        for prompt, future in enumerate(self._futures):
            if not self._ended[prompt]:
                self._ended[prompt] = True
                future.add_done_callback(self._abort_when_queued)

    def _abort_when_queued(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._server.abort(future.result())

    def _client_message(self, error: Exception) -> str:
        """The engine's refusal as this request's client reads it: with one prompt (a chat, a
        one-prompt completion) without the engine's lead "prompt 0 rejected: " or "prompt 0: "
        (its batch index, which that client never sent); with several, as it is (the index is
        the client's own)."""
        message = str(error)
        if self._prompts == 1 and isinstance(error, RequestRejectedError):
            for lead in (f"prompt {error.index} rejected: ", f"prompt {error.index}: "):
                message = message.removeprefix(lead)
        return message

    def _param_of(self, field: Optional[str]) -> Optional[str]:
        """The request field an engine error's ``field`` is (``max_new_tokens``: the API's
        max_tokens or max_completion_tokens; ``beam_width``: n where it defaulted to n; the
        others share their names)."""
        return {"max_new_tokens": self._max_param, "beam_width": self._width_param,
                "lora": "model"}.get(field, field)       # the adapter: the request's model

    async def _aborted(self) -> None:
        """``close()``, then wait for the Ended of every request it aborted (one the engine
        queued: each gets exactly one, after the engine thread's gauges count it gone)."""
        waiting = {prompt for prompt in range(len(self._futures)) if not self._ended[prompt]}
        self.close()
        for prompt in list(waiting):
            try:
                await asyncio.wrap_future(self._futures[prompt])
            except Exception:   # noqa: BLE001 -- refused by the engine: nothing was queued
                waiting.discard(prompt)
        while waiting:
            prompt, item = await self._queue.get()
            if isinstance(item, Ended):
                waiting.discard(prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def response_size(prompts: Sequence[Sequence[int]], params, echo: bool = False,
                  bound: TokenBytes = TokenBytes()) -> ResponseSize:
    """What bounds the response of ``prompts`` run with ``params``, each token at ``bound``: a
    beam search's returned beams carry no logprobs; with ``echo`` (or prompt logprobs) every
    choice repeats its prompt's tokens, each counted as a generated token with the same
    logprobs."""
    beams = isinstance(params, BeamSearchParams)
    echoed = echo or (not beams and params.prompt_logprobs is not None)
    echo_tokens = sum(len(p) for p in prompts) if echoed else 0
    if beams:
        return ResponseSize(len(prompts), params.returned_beams, params.max_new_tokens, None,
                            echo_tokens, bound)
    if params.stop:   # a choice's stop_reason may be its longest stop string (ASCII-escaped: more)
        stop_bytes = max(len(json.dumps(s)) for s in params.stop)
        bound = replace(bound, choice_bytes=bound.choice_bytes + stop_bytes)
    return ResponseSize(len(prompts), params.n, params.max_new_tokens, params.logprobs,
                        echo_tokens, bound)


class ResponseBudget:
    """The response bytes (``ResponseSize.estimate_bytes``) the server's requests may hold at
    once, ``total_bytes``; used on the event loop only. ``reserve`` past it: ApiError 503 with
    Retry-After, nothing reserved; its message never says what the others hold (with
    ``--salt-per-key`` one tenant would read another's request size there): the log does.
    Past an API key's ``key_share_bytes`` (checked first): KeyBudgetError 429, nothing
    reserved, naming that key's own figures only."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes, self.held_bytes = total_bytes, 0
        self._held_by_key: Dict[str, int] = {}     # keys holding some bytes only

    @classmethod
    def of(cls, max_response_bytes: int, total_bytes: Optional[int] = None) -> "ResponseBudget":
        """``total_bytes`` (None: ``RESPONSES_IN_BUDGET`` x ``max_response_bytes``, less where
        the host's MemAvailable holds less, never under one response), or ServeConfigError
        when it is under ``max_response_bytes`` or past MemAvailable (responses are built at
        about ``HELD_BYTES_PER_RESPONSE_BYTE`` x their size)."""
        available_bytes, per = meminfo_bytes("MemAvailable"), HELD_BYTES_PER_RESPONSE_BYTE
        if total_bytes is None:
            total_bytes = RESPONSES_IN_BUDGET * max_response_bytes
            if available_bytes is not None:
                total_bytes = max(max_response_bytes, min(total_bytes, available_bytes // per))
            return cls(total_bytes)
        name = f"max_response_memory_bytes {total_bytes!r} (--max-response-memory-bytes)"
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) \
                or total_bytes < max_response_bytes:
            raise ServeConfigError(f"{name} must be an int >= max_response_bytes "
                                   f"{max_response_bytes} (--max-response-bytes): a response "
                                   f"the limit takes must fit the budget alone")
        if available_bytes is not None and total_bytes * per > available_bytes:
            raise ServeConfigError(f"{name}: building that much response holds about "
                                   f"{total_bytes * per} bytes ({per} x), more than the host "
                                   f"MemAvailable of {available_bytes} bytes; lower it to at "
                                   f"most {available_bytes // per}")
        return cls(total_bytes)

    def held_by(self, key: str) -> int:
        """The bytes ``key``'s reservations hold."""
        return self._held_by_key.get(key, 0)

    def reserve(self, size_bytes: int, key: Optional[str] = None,
                key_share_bytes: Optional[int] = None, retry_after_s: int = 1) -> "Reservation":
        """``size_bytes`` of the budget for a request of ``key`` (None: no API key), which may
        hold ``key_share_bytes`` at most (None: no share)."""
        held_by_key = 0 if key is None else self.held_by(key)
        if key is not None and key_share_bytes is not None \
                and held_by_key + size_bytes > key_share_bytes:
            log.info("refused a response of up to %d bytes of an API key holding %d of its "
                     "%d-byte share of the response budget", size_bytes, held_by_key,
                     key_share_bytes)
            raise KeyBudgetError(held_by_key, size_bytes, key_share_bytes, retry_after_s)
        if self.held_bytes + size_bytes > self.total_bytes:
            log.warning("refused a response of up to %d bytes: %d of the %d-byte response budget "
                        "(--max-response-memory-bytes) are held", size_bytes, self.held_bytes,
                        self.total_bytes)
            raise ApiError(503, f"the server's response budget of {self.total_bytes:,} bytes "
                                f"(--max-response-memory-bytes: responses being made or not yet "
                                f"read by their clients) is too full now for this one, which "
                                f"could take {size_bytes:,}; retry after {retry_after_s} s",
                           headers={"Retry-After": str(retry_after_s)})
        self.held_bytes += size_bytes
        if key is not None:
            self._held_by_key[key] = held_by_key + size_bytes
        return Reservation(self, size_bytes, key)

    def give_back(self, size_bytes: int, key: Optional[str]) -> None:
        self.held_bytes -= size_bytes
        if key is not None:
            left_bytes = self._held_by_key.pop(key) - size_bytes
            if left_bytes:
                self._held_by_key[key] = left_bytes


class Reservation:
    """One request's part of a ResponseBudget (of ``key``); ``release`` gives it back (once)."""

    def __init__(self, budget: ResponseBudget, size_bytes: int, key: Optional[str] = None) -> None:
        self._budget, self.size_bytes, self.key = budget, size_bytes, key

    def release(self) -> None:
        if self._budget is not None:
            self._budget.give_back(self.size_bytes, self.key)
            self._budget = None
