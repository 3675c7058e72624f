"""The engine on its own thread: HTTP handling never blocks a step, a step never blocks accepting.

    HTTP (asyncio)                      engine thread (the only one that touches the Engine)
    submit(ids, params, sink) ──deque──> add_request        ─┐
    abort(request_id)         ──deque──> abort (memory back) │ between steps
    call(work), sleep(), ...  ──deque──> work(engine)        │ (sleep, wake, resize)
                                         step() ─ TokenEvents ┘
    sink(Token | Ended)       <─ call ── on_token / request end

Back-pressure: at most ``max_pending_requests`` requests are in flight (queued, waiting or
running), ``max_requests_per_key`` of one API key (in_flight.py); ``submit`` past either raises
ServerOverloadedError (503) or KeyAtLimitError (429) at once, with Retry-After, so the
backlog is bounded. Every accepted request ends exactly once with ``Ended``: "finished",
"aborted" (``abort``, e.g. on a client disconnect: its pages, blocks and swap space are released
before the next step) or "failed" (its plans kept failing, or a step raised: the engine aborts
every live request, logs the error and goes on).

Sleep: from the moment ``sleep`` is called until a ``wake_up`` has run, ``submit`` refuses with
EngineAsleepError (503 + Retry-After); requests queued before keep waiting (the engine runs no
step while asleep, and this thread waits for a command as when idle, never spinning) and are
served after the wake-up (a ``wake_up`` queued before the ``sleep`` does not count).

Every ``Ended`` reaches its sink after the gauges and ``max_pending_requests`` count its request
gone: a client answered on it finds the request gone from /metrics and from the queue.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestEndedError
from vmemkv.runtime.engine.outputs import RequestError, TokenEvent
from vmemkv.runtime.engine.sampling import SamplingParams

from .errors import ApiError, EngineAsleepError
from .in_flight import RequestsInFlight
from .limits import DEFAULT_MAX_RESPONSE_BYTES
from .metrics import ServeMetrics

if TYPE_CHECKING:
    from .submission import ResponseBudget

log = logging.getLogger("vmemkv.serve")
STOP_WARNING_S = 10.0   # stop(): one warning line when the step under way lasts past this


@dataclass(frozen=True)
class Token:
    """A streamed token and when the engine thread produced it (``time.perf_counter`` s). The
    request's first token also carries its prompt logprobs, when they were asked for."""
    event: TokenEvent
    time_s: float
    prompt_logprobs: Optional[list] = None


@dataclass(frozen=True)
class Ended:
    """The request ended: "finished", "aborted" or "failed" (``error`` says why, for the log;
    ``alone``: the engine failed this request by itself and went on with the others;
    ``cause``: then the engine's RequestError (type name, message, the field at fault), for the
    client's status code and, when its own parameters are at fault, its answer)."""
    status: str
    error: Optional[str] = None
    alone: bool = False
    cause: Optional[RequestError] = None


Sink = Callable[[object], None]   # receives Token and, last, Ended; called on the engine thread


@dataclass
class _Live:
    sink: Sink
    arrival_s: float
    prompt_tokens: int
    samples_left: int
    key: Optional[str]              # the API key it counts against in RequestsInFlight
    token_times_s: Dict[int, List[float]] = field(default_factory=dict)   # sample -> times
    prompt_logprobs: bool = False   # asked for: they travel with the first token
    finish_reasons: List[str] = field(default_factory=list)   # of the samples finished so far


def choices_per_prompt(params) -> int:
    """A request's choices: SamplingParams' n samples, or a beam search's returned beams."""
    return params.returned_beams if isinstance(params, BeamSearchParams) else params.n


class EngineThread:
    """Runs ``engine`` on a daemon thread; ``submit`` and ``abort`` may be called from any thread.
    Each Submission reads the response limits here: ``max_response_bytes`` (one response's
    worst case, ``limits.check_response_bytes``) and ``response_budget`` (what all responses
    may hold at once; None: unbounded), which Server sets from its limits."""

    def __init__(self, engine, metrics: ServeMetrics, max_pending_requests: int = 256,
                 idle_wait_s: float = 0.5,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 response_budget: Optional["ResponseBudget"] = None,
                 max_requests_per_key: Optional[int] = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.in_flight = RequestsInFlight(max_pending_requests, max_requests_per_key)
        self.max_response_bytes, self.response_budget = max_response_bytes, response_budget
        self._idle_wait_s = idle_wait_s
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._asleep = False                  # asleep or going to sleep (guarded by _lock)
        self._sleeps_queued = 0               # sleep() calls not yet run (guarded by _lock)
        self._closed = False                  # no more commands are run (guarded by _lock)
        self._live: Dict[int, _Live] = {}     # engine thread only
        self._ends_held: Optional[list] = None   # in a step or a drain: its ends, held
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vmemkv-engine", daemon=True)

    # ---- any thread ------------------------------------------------------------------------
    @property
    def pending_requests(self) -> int:   # requests accepted by ``submit``, not ended yet
        return self.in_flight.total

    @property
    def queued_commands(self) -> int:
        """Submissions, aborts and calls waiting for the engine thread's next turn."""
        return len(self._commands)

    @property
    def alive(self) -> bool:   # /health: a rank that died closes the engine before the thread ends
        return self._thread.is_alive() and not self.engine.closed

    def start(self) -> None:
        self._refresh_gauges()
        self._thread.start()

    def stop(self, warn_after_s: float = STOP_WARNING_S) -> None:
        """Abort every live request (each gets Ended("aborted")) and join the thread: once this
        returns nothing is inside the engine, which its owner may close. A step under way is
        not cut short (its forward uses the cache): stop waits for it, with one warning line
        after ``warn_after_s`` (a step is bounded by its forward; under tensor parallelism a
        hung rank fails it after ``EngineConfig.tp_timeout_s``)."""
        self._stopping = True
        self._wake.set()
        if not self._thread.is_alive():
            return
        self._thread.join(warn_after_s)
        if self._thread.is_alive():
            log.warning("the engine thread is still inside a step %g s after stop; waiting for "
                        "the step to end before the engine may be closed", warn_after_s)
            self._thread.join()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink,
               arrival_s: float, index: int = 0, key: Optional[str] = None) -> Future:
        """Queue a request (``index``: its prompt's place in the client's request, which the
        engine's refusal names; ``key``: its API key); the future gets its engine request id, or
        the RequestRejectedError the engine raised (nothing queued). At once: ServerOverloadedError
        or KeyAtLimitError (``in_flight.take``), EngineAsleepError while asleep (``sleep``);
        ApiError 503 once the thread has stopped."""
        self._check_running()
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise _not_running()
            if self._asleep:
                raise EngineAsleepError()
            self.in_flight.take(key)
            self._commands.append(("add", (tuple(prompt_ids), params, sink, arrival_s, index,
                                           key), future))
        self._wake.set()
        return future

    def abort(self, request_id: int) -> None:
        """Abort a live request before the next step (no-op when it has already ended)."""
        self._commands.append(("abort", request_id, None))
        self._wake.set()

    def call(self, work: Callable[[object], object]) -> Future:
        """Run ``work(engine)`` on the engine thread between two steps (nothing else touches the
        engine meanwhile); the future gets what it returns or raises; 503 once it stopped."""
        return self._enqueue(work)

    def sleep(self) -> Future:
        """``Engine.sleep()`` between steps (the future: the bytes given back). New requests are
        refused (EngineAsleepError) from now on, until ``wake_up`` has run; if the sleep fails
        (a paged cache cannot give its memory back), they are taken again; an engine that cannot
        sleep (``Engine.resizable``) refuses it without turning requests away meanwhile."""
        turns_away = self.engine.resizable
        return self._enqueue(self._settled(lambda engine: engine.sleep(), sleep=turns_away),
                             sleep=turns_away)

    def wake_up(self) -> Future:
        """``Engine.wake()`` between steps (the future: the cache bytes after); new requests
        are taken once it has run."""
        return self._enqueue(self._settled(lambda engine: engine.wake()))

    def _enqueue(self, work, sleep: bool = False) -> Future:
        self._check_running()
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise _not_running()
            if sleep:   # refused from now on, whatever runs before it (a queued wake_up)
                self._sleeps_queued += 1
                self._asleep = True
            self._commands.append(("call", work, future))
        self._wake.set()
        return future

    def _settled(self, work, sleep: bool = False):
        """``work`` (``sleep``: a queued sleep's), after which new requests are refused exactly
        while the engine sleeps or a sleep is still queued."""
        def run(engine):
            try:
                return work(engine)
            finally:
                with self._lock:
                    if sleep:
                        self._sleeps_queued -= 1
                    self._asleep = engine.is_sleeping or self._sleeps_queued > 0
        return run

    def _check_running(self) -> None:
        if self._stopping or (self._thread.ident is not None and not self._thread.is_alive()):
            raise _not_running()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_commands()
                if self.engine.has_unfinished() and not self.engine.is_sleeping:
                    self._step()
                else:   # idle, or asleep with requests waiting: wait for a command or a request
                    self._rebalance()
                    self._wake.wait(self._idle_wait_s)
        finally:   # even after an unexpected error: every request and command still ends
            with self._lock:
                self._closed = True   # a command from now on is refused, none waits forever
            self._drain_commands()
            for request_id in list(self._live):
                self._abort(request_id, "aborted")

    def _rebalance(self) -> None:
        """An idle engine that shares a MemoryBudget gives its pages back after the budget's
        ``idle_release_s`` (``Engine.rebalance_memory``; nothing without a budget)."""
        before = self.engine.cache_bytes
        try:
            self.engine.rebalance_memory()
        except Exception:   # noqa: BLE001 -- the server stays up; the log keeps it
            log.exception("giving the idle engine's memory back failed")
        if self.engine.cache_bytes != before:
            self._refresh_gauges()

    def _drain_commands(self) -> None:
        """Every queued command; the ends of the requests it aborted reach their clients after
        the gauges count them gone."""
        with self._ends_after_gauges():
            while self._commands:
                kind, payload, future = self._commands.popleft()
                if kind == "add":
                    self._add(payload, future)
                elif kind == "call":
                    self._call(payload, future)
                else:
                    self._abort(payload, "aborted")
            self._refresh_gauges()

    def _add(self, payload, future: Future) -> None:
        """Add a queued request unless its future was cancelled (a cancelled handler's): no reader."""
        prompt_ids, params, sink, arrival_s, index, key = payload
        if not future.set_running_or_notify_cancel():
            self.in_flight.give_back(key)
            return
        beams = isinstance(params, BeamSearchParams)
        add = self.engine.add_beam_request if beams else self.engine.add_request
        try:
            request_id = add(list(prompt_ids), params, index=index, on_token=self._on_token)
        except Exception as error:   # noqa: BLE001 -- handed to the submitter, who answers it
            self.in_flight.give_back(key)
            future.set_exception(error)
            return
        self._live[request_id] = _Live(sink, arrival_s, len(prompt_ids), choices_per_prompt(params),
                                       key, prompt_logprobs=not beams
                                       and params.prompt_logprobs is not None)
        future.set_result(request_id)

    def _call(self, work, future: Future) -> None:
        """``work(engine)``; its answer reaches the caller after the gauges it changed (a
        client with its /resize, /sleep or /wake_up answer that reads /metrics sees them); a
        cancelled future's work runs (a queued sleep's count settles), unanswered."""
        answered = future.set_running_or_notify_cancel()
        try:
            result, error = work(self.engine), None
        except Exception as caught:   # noqa: BLE001 -- handed to the caller, who answers it
            result, error = None, caught
        self._refresh_gauges()
        if answered and error is None:
            future.set_result(result)
        elif answered:
            future.set_exception(error)

    def _step(self) -> None:
        """One engine step. The ends of the requests it finished reach their clients after the
        gauges count them gone: a client that has its answer and reads /metrics sees them so."""
        with self._ends_after_gauges():
            try:
                self.engine.step()
            except Exception as error:   # noqa: BLE001 -- the server stays up; the log keeps it
                ran = () if self.engine.closed else self.engine.failed_step_request_ids
                ended = ran or list(self._live)     # the requests it ran; closed: every one
                log.exception("an engine step failed; aborting %d requests", len(ended))
                for request_id in ended:
                    self._abort(request_id, "failed", f"{type(error).__name__}: {error}")
                if self.engine.closed:   # a rank died and closed it: nothing left to serve
                    self._stopping = True
                    return
            self._end_failed()
            self._refresh_gauges()

    @contextlib.contextmanager
    def _ends_after_gauges(self):
        """The Ended items made inside are held (``_end``) and delivered on leaving, after
        the gauge refresh that ends the block."""
        self._ends_held = []
        try:
            yield
        finally:
            held, self._ends_held = self._ends_held, None
            for sink, item in held:
                _deliver(sink, item)

    def _on_token(self, event: TokenEvent) -> None:
        live = self._live.get(event.request_id)
        if live is None:
            return
        now = time.perf_counter()
        prompt_logprobs = None
        if live.prompt_logprobs and not live.token_times_s:   # the request's first token
            prompt_logprobs = self.engine.output(event.request_id).prompt_logprobs
        live.token_times_s.setdefault(event.index, []).append(now)
        _deliver(live.sink, Token(event, now, prompt_logprobs))
        if event.finished:
            live.finish_reasons.append(event.finish_reason)
            live.samples_left -= 1
            if not live.samples_left:
                self._end(event.request_id, "finished")

    def _abort(self, request_id: int, status: str, error: Optional[str] = None) -> None:
        if request_id not in self._live:
            return
        try:
            self.engine.abort(request_id)
        except RequestEndedError:   # it ended in the step that just ran
            pass
        except Exception:   # noqa: BLE001 -- the engine is closed (a tensor-parallel rank died)
            log.debug("abort of request %d on a closed engine", request_id, exc_info=True)
        self._end(request_id, status, error)   # its client hears of it whatever happened

    def _end_failed(self) -> None:
        """Requests the engine ended "failed" by themselves end here too."""
        for request_id in list(self._live):   # status: a live output() is a copy
            if self.engine.status(request_id) == "failed":
                out = self.engine.output(request_id)
                error = f"{out.error.type}: {out.error.message}" if out.error else None
                log.error("request %d failed alone (the others go on): %s", request_id, error)
                self._end(request_id, "failed", error, alone=True, cause=out.error)

    def _end(self, request_id: int, status: str, error: Optional[str] = None,
             alone: bool = False, cause: Optional[RequestError] = None) -> None:
        live = self._live.pop(request_id)
        self.engine.output(request_id, pop=True)
        self.metrics.observe_request(live.arrival_s, live.token_times_s, live.prompt_tokens, status,
                                     live.finish_reasons)
        self.in_flight.give_back(live.key)
        ended = Ended(status, error, alone, cause)
        if self._ends_held is not None:      # after the gauges (_ends_after_gauges)
            self._ends_held.append((live.sink, ended))
        else:
            _deliver(live.sink, ended)

    def _refresh_gauges(self) -> None:
        engine = self.engine
        self.metrics.set_gauges(dict(engine.scheduler.gauges(), kv_cache_bytes=engine.cache_bytes,
                                     is_sleeping=int(engine.is_sleeping),
                                     **engine.adapters.gauges()))


def _not_running() -> ApiError:
    return ApiError(503, "the engine is not running (the server is stopping)")


def _deliver(sink: Sink, item) -> None:
    try:
        sink(item)
    except Exception:   # noqa: BLE001 -- a gone client (closed loop) must not stop the engine
        log.debug("dropped an event for a request whose client is gone", exc_info=True)
