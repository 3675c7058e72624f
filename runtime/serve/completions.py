"""One completion request on the HTTP side: its prompt checked against the served engine, its
events carried from the engine thread to the event loop, and its choices assembled.

A request that leaves early (the client disconnected, or every choice hit a stop string) is
aborted on the engine thread, which releases its memory before the next step.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, List, Optional, Tuple

from vmemkv.runtime.engine.errors import RequestRejectedError

from .engine_thread import Ended, EngineThread, Token
from .errors import ApiError, internal_error
from .protocol import CompletionRequest
from .text import ChoiceText


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the model's id, its tokenizer and the engine's limits."""
    name: str
    tokenizer: object
    vocab_size: int
    max_sequence_tokens: int   # prompt + max_tokens one sequence can hold
    max_n: int                 # choices per request: the engine's max_batch

    @classmethod
    def of(cls, engine, name: str) -> "ServedModel":
        sched = engine.scheduler
        limit = min(x for x in (sched.max_seq_len, sched.max_fit_tokens) if x)
        return cls(name, engine.tokenizer, engine.vocab_size, limit, engine.config.max_batch)


def prompt_token_ids(req: CompletionRequest, served: ServedModel) -> List[int]:
    """The prompt as token ids, or ApiError 400 naming ``model``, ``prompt``, ``max_tokens``,
    ``n`` or ``stop``."""
    if req.model is not None and req.model != served.name:
        raise ApiError(400, f"model {req.model!r} is not served here; this server serves "
                            f"{served.name!r}", "model")
    if isinstance(req.prompt, str):
        if served.tokenizer is None:
            raise ApiError(400, "prompt is text but the served model has no tokenizer; send "
                                "token ids (a list of ints)", "prompt")
        ids = list(served.tokenizer(req.prompt)["input_ids"])
    else:
        ids = list(req.prompt)
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise ApiError(400, f"prompt has token ids {bad[:5]} outside the vocabulary "
                            f"[0, {served.vocab_size})", "prompt")
    _check_lengths(req, served, len(ids))
    if req.stop is not None and served.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; send stop_token_ids instead", "stop")
    return ids


def _check_lengths(req: CompletionRequest, served: ServedModel, prompt_tokens: int) -> None:
    limit = served.max_sequence_tokens
    if prompt_tokens + req.max_tokens > limit:
        param = "prompt" if prompt_tokens >= limit else "max_tokens"
        raise ApiError(400, f"this model's context is {limit} tokens; the request asks for "
                            f"{prompt_tokens + req.max_tokens} ({prompt_tokens} in the prompt, "
                            f"{req.max_tokens} max_tokens)", param)
    if req.n > served.max_n:
        raise ApiError(400, f"n must be at most {served.max_n} (the server's --max-batch), "
                            f"got {req.n}", "n")


class Completion:
    """A submitted request: ``events()`` yields (choice index, text delta, token ids delta,
    finish_reason) as tokens arrive; ``close()`` aborts it if it has not ended."""

    def __init__(self, server: EngineThread, req: CompletionRequest, prompt_ids: List[int],
                 served: ServedModel, arrival_s: float) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.prompt_tokens = len(prompt_ids)
        self.choices = [ChoiceText(served.tokenizer, req.stop_strings()) for _ in range(req.n)]
        self._server, self._ended = server, False
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sink = lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item)  # noqa: E731
        self._future = server.submit(prompt_ids, req.sampling_params(), sink, arrival_s)

    async def started(self) -> None:
        """Wait until the engine has queued it; ApiError 400 if the engine refused it."""
        try:
            await asyncio.wrap_future(self._future)
        except RequestRejectedError as error:
            self._ended = True
            raise ApiError(400, str(error), "prompt") from None

    async def events(self) -> AsyncIterator[Tuple[int, str, List[int], Optional[str]]]:
        while not self._ended:
            item = await self._queue.get()
            if isinstance(item, Ended):
                self._ended = True
                if item.status != "finished" and not all(c.finished for c in self.choices):
                    raise internal_error()
                return
            assert isinstance(item, Token)
            choice = self.choices[item.event.index]
            delta, ids = choice.add(item.event.token_id, item.event.finish_reason)
            if ids:
                yield item.event.index, delta, ids, choice.finish_reason
            if all(c.finished for c in self.choices) and any(c.cut for c in self.choices):
                self.close()   # stop strings ended it before the engine did: free it now
                return

    def close(self) -> None:
        """Abort the request if it is still live (a disconnect, or stop strings ended it)."""
        if self._ended:
            return
        self._ended = True
        self._future.add_done_callback(self._abort_when_queued)

    def _abort_when_queued(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._server.abort(future.result())

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)
