"""A future the engine thread answers may have been cancelled by its caller meanwhile (asyncio's
wrap_future cancels it with a cancelled handler): ``set_result`` then raised InvalidStateError
out of the engine thread, which ended it: every live request aborted and every later request
503 "the engine is not running". Now a cancelled submission is never added (its in-flight
count given back) and a cancelled call runs unanswered; the thread serves on."""
from __future__ import annotations

import time

from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve.engine_thread import Ended, EngineThread
from vmemkv.runtime.serve.metrics import ServeMetrics

from .test_engine_thread import FakeEngine


def _ended(sink: list) -> Ended:
    for _ in range(3000):                   # a bound on a hang, not a timing check
        if sink and isinstance(sink[-1], Ended):
            return sink[-1]
        time.sleep(0.01)
    raise AssertionError(f"no end after 30 s: {sink}")


def test_a_submission_and_a_call_cancelled_before_the_thread_takes_them_leave_it_serving():
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("m"), idle_wait_s=0.01)
    cancelled = thread.submit([1, 2, 3], SamplingParams(max_new_tokens=2), lambda item: None, 0.0)
    ran = []
    call = thread.call(lambda e: ran.append("resize") or 7)
    sleep = thread.sleep()
    assert cancelled.cancel() and call.cancel() and sleep.cancel()
    thread.start()
    try:
        assert thread.wake_up().result(timeout=30) == 4096   # the cancelled sleep ran first
        ended: list = []
        done = thread.submit([1, 2], SamplingParams(max_new_tokens=2), ended.append, 0.0)
        assert done.result(timeout=30) == 0          # the cancelled one was never added
        assert _ended(ended).status == "finished"
        assert ran == ["resize"] and thread.alive and thread.pending_requests == 0
    finally:
        thread.stop()
