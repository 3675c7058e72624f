"""An Engine served over HTTP: the engine thread, the app and uvicorn, started and stopped together.

    with Server(engine, "tiny-llama", port=0).start() as server:   # uvicorn on a thread
        print(server.url)                                           # http://127.0.0.1:PORT
    Server(engine, "tiny-llama", port=8000).run()                   # blocking, for the CLI

Stopping (``stop``, leaving the ``with``, SIGTERM or Ctrl-C on ``run``) closes the listening
socket, lets the requests in flight run for ``limits.shutdown_timeout_s``, ends the rest (an
error event and ``[DONE]`` for a stream, 503 for a JSON request: shutdown.py), aborts what is
still live (its memory is released) and joins the engine thread, after the step under way
(``EngineThread.stop``); the engine itself stays open for its owner to close. Client limits
(limits.py) and API keys (auth.py) are enforced in front of the app; a request whose response
could pass ``limits.max_response_bytes`` is refused before it is queued (submission.py), and one
past the responses all requests may hold at once (``max_response_memory_bytes``:
submission.ResponseBudget) is a 503 + Retry-After; one past its API key's
``max_requests_per_key`` in flight (in_flight.py) a 429 + Retry-After. A connection whose client reads nothing of
its answer for ``send_timeout_s`` (its transport stays write-paused) is dropped, its request
aborted and its response's memory given back.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable, Optional

from .errors import ServeConfigError
from .limits import cancel_timer

log = logging.getLogger("vmemkv.serve")
STOP_MARGIN_S = 5.0   # stop(): past the drain and its grace, for uvicorn to close its sockets
DEFAULT_SEND_TIMEOUT_S = 60.0   # a client may read nothing of its answer this long


def require_serve_extra() -> None:
    """ServeConfigError naming the extra when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ServeConfigError(f"serving needs the 'serve' extra (FastAPI, uvicorn): pip install "
                               f"'vmemkv[serve]' ({error})") from None


class Server:
    """``engine`` behind the OpenAI-compatible API on ``host:port`` (port 0: a free one)."""

    def __init__(self, engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                 max_queue: int = 256, log_level: str = "warning",
                 limits: Optional["ServeLimits"] = None, auth: Optional["AuthConfig"] = None,
                 on_started: Callable[[int], None] = lambda port: None,
                 lora_root=None, max_response_memory_bytes: Optional[int] = None,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 max_requests_per_key: Optional[int] = None) -> None:
        require_serve_extra()
        import uvicorn

        from .app import create_app
        from .auth import AuthConfig, Guard
        from .limits import ServeLimits, guarded_protocol
        from .shutdown import Drain, draining_server
        from .completions import ServedModel
        from .engine_thread import EngineThread
        from .in_flight import check_max_requests_per_key
        from .metrics import ServeMetrics
        from .submission import ResponseBudget
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ServeConfigError(f"max_queue must be an int >= 1, got {max_queue!r}")
        check_send_timeout(send_timeout_s)
        self.limits, self.auth = limits or ServeLimits(), auth or AuthConfig()
        check_max_requests_per_key(max_requests_per_key, self.auth.api_keys, max_queue,
                                   self.limits.max_connections)
        self.metrics = ServeMetrics(model_name)
        # each Submission reads its response limit and budget there (submission.py, limits.py)
        budget = ResponseBudget.of(self.limits.max_response_bytes, max_response_memory_bytes)
        self.engine_thread = EngineThread(engine, self.metrics, max_pending_requests=max_queue,
                                          max_response_bytes=self.limits.max_response_bytes,
                                          response_budget=budget,
                                          max_requests_per_key=max_requests_per_key)
        self.drain = Drain()
        app = Guard(create_app(self.engine_thread, self.metrics, ServedModel.of(engine, model_name, self.limits, max_queue),
                               self.drain, lora_root), self.limits, self.auth)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                http=send_timed(guarded_protocol(self.limits), send_timeout_s))
        self._uvicorn = draining_server(config, self.drain, self.limits.shutdown_timeout_s,
                                        on_started=lambda: on_started(self.port))
        self._thread: Optional[threading.Thread] = None
        self.host = host
        # a second Ctrl-C cut run()'s wait for the step under way: the engine thread may still
        # be inside the engine, which must not be closed then (its step uses the cache); the
        # process exits and the OS reclaims the memory. Not the thread's is_alive(): Python
        # 3.11's interrupted join() marks a running thread stopped.
        self.engine_thread_abandoned = False

    @property
    def port(self) -> int:
        """The port listened on (the one picked, for port 0); only once started."""
        return self._uvicorn.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> str:
        """Serve until SIGTERM, Ctrl-C (or ``stop`` from another thread), then stop everything;
        returns one line saying how it stopped (KeyboardInterrupt carrying it on Ctrl-C). A
        second Ctrl-C while the engine thread finishes its step ends that wait (KeyboardInterrupt
        saying so) and sets ``engine_thread_abandoned``."""
        self.engine_thread.start()
        try:
            self._serve()
        finally:
            try:
                self.engine_thread.stop()
            except KeyboardInterrupt:   # the wait for the step under way, cut short
                self.engine_thread_abandoned = True
                raise KeyboardInterrupt("a second Ctrl-C while the engine thread finished its "
                                        "step: exited without waiting for it") from None
        received = self._uvicorn.received
        how = ("SIGTERM" if signal.SIGTERM in received else "Ctrl-C" if received else "stop()")
        line = (f"stopped on {how}: stopped accepting, {self.drain.cut} request(s) still running "
                f"after the {self.limits.shutdown_timeout_s:g} s drain were ended (503 / an error "
                f"event and [DONE])")
        if signal.SIGINT in received and signal.SIGTERM not in received:
            raise KeyboardInterrupt(line)
        return line

    def _serve(self) -> None:
        try:
            self._uvicorn.run()
        except SystemExit:   # uvicorn exits when it cannot bind; the log above says why
            raise ServeConfigError(f"could not listen on {self.host}:{self._uvicorn.config.port} "
                                   f"(taken, or not an address of this machine)") from None

    def start(self, timeout_s: float = 30.0) -> "Server":
        """Serve on a background thread; returns once the socket listens."""
        self.engine_thread.start()
        self._thread = threading.Thread(target=self._serve, name="vmemkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeConfigError(f"the server did not start on {self.host} within "
                                       f"{timeout_s} s (is the port taken?)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Close the socket, let the requests in flight drain for ``shutdown_timeout_s`` (then
        they are ended: shutdown.py), abort what is still live, join both threads.
        Idempotent."""
        from .shutdown import GRACE_S
        self._uvicorn.should_exit = True
        if self._thread is not None:   # the drain, the handlers' last word, then a margin
            self._thread.join(self.limits.shutdown_timeout_s + GRACE_S + STOP_MARGIN_S)
            if self._thread.is_alive():
                log.warning("the HTTP thread outlived its %g s drain; stopping the engine "
                            "thread under it", self.limits.shutdown_timeout_s)
            self._thread = None
        self.engine_thread.stop()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def check_send_timeout(send_timeout_s) -> None:
    if isinstance(send_timeout_s, bool) or not isinstance(send_timeout_s, (int, float)) \
            or not 0 < send_timeout_s < float("inf"):
        raise ServeConfigError(f"send_timeout_s (--send-timeout) must be a finite number of "
                               f"seconds > 0, got {send_timeout_s!r}")


def send_timed(protocol, send_timeout_s: float):
    """``protocol`` (uvicorn's h11 one, or a subclass) that aborts a connection whose transport
    stays write-paused (its buffer over the high-water mark: the client reads nothing) for
    ``send_timeout_s``: uvicorn ends its request as a disconnect (a stream's requests are
    aborted, a JSON answer's budget is given back). ``abort``: ``close`` would wait for the
    unread bytes."""
    class SendTimedProtocol(protocol):
        def pause_writing(self) -> None:
            super().pause_writing()
            self._disarm_send_timer()
            self._send_timer = self.loop.call_later(send_timeout_s, self._send_stalled)

        def resume_writing(self) -> None:
            self._disarm_send_timer()
            super().resume_writing()

        def connection_lost(self, exc) -> None:
            self._disarm_send_timer()
            super().connection_lost(exc)

        def _disarm_send_timer(self) -> None:
            cancel_timer(self, "_send_timer")

        def _send_stalled(self) -> None:
            self._send_timer = None
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.warning("dropped %s: it read nothing of its answer for %g s (--send-timeout)",
                        client, send_timeout_s)
            self.transport.abort()

    return SendTimedProtocol
