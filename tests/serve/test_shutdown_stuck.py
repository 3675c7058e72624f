"""shutdown.DrainingServer.shutdown with requests whose clients never read (their writes wait
on the client): after the drain and its grace each is counted in ``Drain.cut`` once, and its
connection is aborted, which ends it; it used to be cancelled (uvicorn logged a ~50-line
CancelledError traceback) and not counted ("0 request(s) still running ... were ended").
No socket, no model: fake connections and tasks that wait on their transport's abort."""
from __future__ import annotations

import asyncio
import logging

import pytest

uvicorn = pytest.importorskip("uvicorn")

from vmemkv.runtime.serve import shutdown  # noqa: E402
from vmemkv.runtime.serve.errors import ApiError  # noqa: E402


class Connection:
    """A connection whose client reads nothing: only abort() frees its write."""

    def __init__(self) -> None:
        self.freed = asyncio.Event()
        self.transport = self

    def abort(self) -> None:
        self.freed.set()

    def shutdown(self) -> None:      # uvicorn's: a request in flight keeps its connection
        pass


async def never():
    await asyncio.Event().wait()
    yield None


async def app(scope, receive, send) -> None:
    pass


def test_requests_stuck_on_clients_that_do_not_read_are_counted_once_and_dropped(
        monkeypatch, caplog):
    monkeypatch.setattr(shutdown, "GRACE_S", 0.3)   # bounds only: nothing waits on it to pass
    drain = shutdown.Drain()
    server = shutdown.draining_server(uvicorn.Config(app, lifespan="off"), drain, 0.0)
    server.servers = []
    ended_by = []

    async def cut_then_stuck(connection: Connection) -> None:
        try:                         # the guard cuts it (counted), its error event then waits
            async for _ in drain.guard(never()):
                pass
        except ApiError as error:
            assert error.status == 503
        await connection.freed.wait()
        ended_by.append("abort")

    async def stuck_then_cut(connection: Connection) -> None:
        await connection.freed.wait()   # a token's write waits from before the drain's end
        try:                         # freed after the grace: the guard must not count it again
            async for _ in drain.guard(never()):
                pass
        except ApiError:
            pass
        ended_by.append("abort")

    async def main() -> list:
        tasks = []
        for run in (cut_then_stuck, stuck_then_cut):
            connection = Connection()
            server.server_state.connections.add(connection)
            task = asyncio.ensure_future(run(connection))
            task.add_done_callback(server.server_state.tasks.discard)
            server.server_state.tasks.add(task)
            tasks.append(task)
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger="vmemkv.serve"):
            await server.shutdown()
        return tasks

    tasks = asyncio.run(main())
    assert [task.cancelled() for task in tasks] == [False, False]   # ended, never cancelled
    assert ended_by == ["abort", "abort"]
    assert drain.cut == 2                                           # each once
    assert "dropped 2 connection(s) whose client did not read its answer" in caplog.text
