"""/health once a tensor-parallel rank's death has closed the engine: 503 at once, not 200
until the engine thread notices and stops (``EngineThread.alive`` read only the thread)."""
from __future__ import annotations

import asyncio

import httpx

from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.engine_thread import EngineThread
from vmemkv.runtime.serve.metrics import ServeMetrics

from ..engine.byte_tokenizer import byte_tokenizer
from .test_engine_thread import FakeEngine


def health_status(engine_thread: EngineThread) -> int:
    served = ServedModel("m", byte_tokenizer(chat_template=True), 256, 64, 8)
    app = create_app(engine_thread, ServeMetrics("m"), served)

    async def get() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/health", timeout=10)).status_code

    return asyncio.run(get())


def test_health_is_503_as_soon_as_the_engine_is_closed_while_its_thread_still_runs():
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), idle_wait_s=0.01)
    thread.start()
    try:
        assert thread.alive and health_status(thread) == 200
        engine.closed = True      # a rank died: Engine.abandon closed it inside a step
        assert thread._thread.is_alive()            # the thread has not stopped yet
        assert not thread.alive and health_status(thread) == 503
    finally:
        thread.stop()
    assert not thread.alive and health_status(thread) == 503
