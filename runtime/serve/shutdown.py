"""Graceful shutdown: SIGTERM or Ctrl-C stops accepting, lets requests in flight finish for
``shutdown_timeout_s``, then ends each open stream with an error event and ``[DONE]`` and each
pending JSON request with 503; nothing is cut without a word.

    signal (or Server.stop)   listeners closed: no new connection; keep-alive connections get
                              503 for a new request (``Drain.draining``)
    drain                     requests in flight run on, up to shutdown_timeout_s
    expire                    ``Drain.expired`` fires: streams send an error event and [DONE],
                              JSON requests answer 503; each request is aborted (memory back)
    grace                     GRACE_S later, a request still running is one whose client does
                              not read its answer: each is counted in ``Drain.cut``, its
                              connection dropped (one log line), which ends it without a traceback
    exit                      SIGTERM: exit 0 with one line; Ctrl-C: 130 (the CLI's interrupt)

``DrainingServer`` is uvicorn's server with that shutdown, and signals that are not re-raised
after it (uvicorn re-raises them, which killed the process with -15 and no message).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import weakref
from typing import AsyncIterator, Callable, List, Optional

from .errors import ApiError

log = logging.getLogger("vmemkv.serve")
GRACE_S = 5.0     # after expiry: time for handlers to write their last event or 503


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance",
                    headers={"Retry-After": "1"})


class Drain:
    """Shared by the server and the request handlers, on the event loop's thread."""

    def __init__(self) -> None:
        self.draining = False
        self.cut = 0                     # requests ended by the expiry
        self._expired: Optional[asyncio.Event] = None
        self._counted: "weakref.WeakSet[asyncio.Task]" = weakref.WeakSet()  # guard's cuts' tasks
        self._settled = False            # every request left is counted: nothing adds more

    @property
    def expired(self) -> asyncio.Event:
        if self._expired is None:
            self._expired = asyncio.Event()
        return self._expired

    async def guard(self, events) -> AsyncIterator:
        """``events`` (an async iterator) until the drain expires; then ApiError 503."""
        iterator = events.__aiter__()
        expired = asyncio.ensure_future(self.expired.wait())
        step = None
        try:
            while True:
                step = asyncio.ensure_future(iterator.__anext__())
                await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    self._count_cut()
                    raise shutting_down()
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:                         # a cancelled stream leaves no task behind
            expired.cancel()
            if step is not None and not step.done():
                step.cancel()
            elif step is not None and not step.cancelled():
                step.exception()         # retrieved: never "exception was never retrieved"


    def _count_cut(self) -> None:
        if self._settled:                # counted when its connection was dropped
            return
        self.cut += 1
        task = asyncio.current_task()
        if task is not None:
            self._counted.add(task)

    def settle(self, stuck: List[asyncio.Task]) -> int:
        """Count ``stuck`` (the requests still running after the grace) in ``cut``, each once:
        those whose guard already counted it still run (their last event not sent), the
        rest were not counted. Later cuts count nothing. Returns how many were added."""
        already = sum(1 for task in self._counted if not task.done())
        added = max(0, len(stuck) - already)
        self.cut += added
        self._settled = True
        return added


def draining_server(config, drain: Drain, shutdown_timeout_s: float,
                    on_started: Callable[[], None] = lambda: None):
    """A uvicorn.Server for ``config`` with the shutdown above; ``received`` lists the signals
    it got, ``on_started()`` runs once it listens."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        received: List[int] = []

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                on_started()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:                     # restored, not re-raised: the caller decides the exit
                for sig, handler in original.items():
                    signal.signal(sig, handler)
                self.received = list(self._captured_signals)

        def handle_exit(self, sig, frame) -> None:
            self._captured_signals.append(sig)
            if self.should_exit:         # a second signal: end the drain now
                self.force_exit = True
                drain.expired.set()
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            drain.draining = True
            for server in self.servers:
                server.close()           # stop accepting
            for connection in list(self.server_state.connections):
                connection.shutdown()
            live = len(self.server_state.tasks)
            if live:
                log.info("draining %d request(s) for up to %g s", live, shutdown_timeout_s)
            if not await _wait_for(self.server_state.tasks, shutdown_timeout_s):
                drain.expired.set()
                if not await _wait_for(self.server_state.tasks, GRACE_S):
                    self._drop_stuck()
                    if not await _wait_for(self.server_state.tasks, GRACE_S):
                        for task in list(self.server_state.tasks):
                            task.cancel()   # counted above; never seen in tests
            for server in self.servers:
                await server.wait_closed()

        def _drop_stuck(self) -> None:
            """The requests still running: their clients do not read (a write waits on them).
            Each is counted, and its connection aborted (close would wait for the unread
            bytes): uvicorn then ends the request as a disconnect, no CancelledError logged."""
            stuck = list(self.server_state.tasks)
            drain.settle(stuck)
            log.warning("dropped %d connection(s) whose client did not read its answer within "
                        "%g s of the drain's end", len(stuck), GRACE_S)
            for connection in list(self.server_state.connections):
                if connection.transport is not None:
                    connection.transport.abort()

    return DrainingServer(config)


async def _wait_for(tasks: set, timeout_s: float) -> bool:
    """Whether ``tasks`` all ended within ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while tasks:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
