"""EngineThread against a shadow: whatever the interleaving of submissions, overloads and
aborts from the client side, every accepted request gets its tokens in order and then exactly
one Ended; the in-flight count is the shadow's; nothing stays live in the engine."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from vmemkv.runtime.engine.errors import RequestEndedError, RequestRejectedError
from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve import ApiError, EngineAsleepError, ServerOverloadedError
from vmemkv.runtime.serve.engine_thread import Ended, EngineThread, Token
from vmemkv.runtime.serve.metrics import ServeMetrics


class FakeEngine:
    """The Engine calls EngineThread makes: one token per live request per step, token id =
    its position; a prompt [0] is rejected."""

    def __init__(self) -> None:
        self.live, self.callbacks, self.outputs, self.next_id = {}, {}, {}, 0
        self.scheduler = SimpleNamespace(gauges=lambda: {"num_requests_running": len(self.live)})
        self.adapters = SimpleNamespace(gauges=lambda: {"lora_adapters_loaded": 0})
        self.cache_bytes, self.is_sleeping, self.looks = 4096, False, 0
        self.closed = False      # Engine.closed: a tensor-parallel rank died and closed it
        self.resizable = True    # Engine.resizable: it can sleep
        self.failed_step_request_ids = ()   # Engine's: none named, a raising step ends all

    def sleep(self) -> int:
        released, self.cache_bytes, self.is_sleeping = self.cache_bytes, 0, True
        return released

    def rebalance_memory(self) -> None:
        pass

    def wake(self) -> int:
        self.cache_bytes, self.is_sleeping = 4096, False
        return self.cache_bytes

    def add_request(self, prompt, params, on_token, index=0):
        if prompt == [0]:
            raise RequestRejectedError("prompt 0 rejected")
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = [0, params.max_new_tokens]
        self.callbacks[rid] = on_token
        self.outputs[rid] = SimpleNamespace(status="unfinished", error=None)
        return rid

    def has_unfinished(self) -> bool:
        self.looks += 1
        return bool(self.live)

    def step(self) -> None:
        assert not self.is_sleeping, "a step while asleep"
        events = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            done = state[0] == state[1]
            events.append(TokenEvent(rid, 0, state[0] - 1, done, "length" if done else None))
            if done:
                del self.live[rid]
                self.outputs[rid].status = "finished"
        for event in events:
            self.callbacks[event.request_id](event)

    def abort(self, rid):
        if rid not in self.live:
            raise RequestEndedError(f"request {rid} has already ended")
        del self.live[rid]
        self.outputs[rid].status = "aborted"

    def output(self, rid, pop=False):
        return self.outputs.pop(rid) if pop else self.outputs[rid]

    def status(self, rid) -> str:
        return self.outputs[rid].status


REQUEST = st.tuples(st.integers(1, 6), st.one_of(st.none(), st.integers(1, 6)), st.booleans())


@settings(max_examples=40)
@given(requests=st.lists(REQUEST, min_size=1, max_size=12), max_pending=st.integers(1, 8))
def test_every_accepted_request_streams_in_order_then_ends_once(requests, max_pending):
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), max_pending_requests=max_pending,
                          idle_wait_s=0.01)
    received, accepted, futures = {}, [], []
    for i, (tokens, leave_after, rejected) in enumerate(requests):   # before start: nothing ends
        seen = received.setdefault(i, [])

        def sink(item, seen=seen, leave_after=leave_after, i=i):
            seen.append(item)
            if isinstance(item, Token) and len(seen) == leave_after:
                thread.abort(futures_by_index[i].result())   # the client hangs up
        try:
            future = thread.submit([0] if rejected else [1], SamplingParams(max_new_tokens=tokens),
                                   sink, arrival_s=0.0)
        except ServerOverloadedError:
            assert len(accepted) == max_pending   # the shadow: full exactly at the limit
            continue
        accepted.append(i)
        futures.append((i, future))
    futures_by_index = dict(futures)
    assert thread.pending_requests == len(accepted)
    thread.start()
    deadline = time.monotonic() + 300   # a deadlock guard, not a timing check
    while thread.pending_requests:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    thread.stop()
    for i in accepted:
        tokens, leave_after, rejected = requests[i]
        if rejected:
            assert isinstance(futures_by_index[i].exception(), RequestRejectedError)
            assert received[i] == []
            continue
        items = received[i]
        ends = [x for x in items if isinstance(x, Ended)]
        assert len(ends) == 1 and items[-1] is ends[0]
        ids = [x.event.token_id for x in items[:-1]]
        assert ids == list(range(len(ids)))
        if leave_after is None or leave_after >= tokens:
            assert ends[0].status == "finished" and len(ids) == tokens
        else:
            assert ends[0].status == "aborted" and len(ids) == leave_after
    assert not engine.live and not engine.outputs
    with pytest.raises(ApiError, match="not running"):
        thread.submit([1], SamplingParams(), lambda item: None, arrival_s=0.0)


def test_a_step_that_raises_fails_every_live_request_and_the_thread_goes_on():
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), idle_wait_s=0.01)
    ended = threading.Event()
    items = []
    real_step, engine.step = engine.step, lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    thread.start()
    thread.submit([1], SamplingParams(max_new_tokens=3),
                  lambda item: (items.append(item), isinstance(item, Ended) and ended.set()), 0.0)
    assert ended.wait(10)
    assert items == [Ended("failed", "RuntimeError: boom")] and not engine.live
    engine.step = real_step
    done = threading.Event()
    thread.submit([1], SamplingParams(max_new_tokens=2),
                  lambda item: isinstance(item, Ended) and done.set(), 0.0)
    assert done.wait(10) and thread.alive
    thread.stop()


def test_asleep_the_thread_waits_without_stepping_or_spinning_and_serves_the_queue_after():
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), idle_wait_s=0.05)
    ended, items = threading.Event(), []
    gate = threading.Event()
    step, engine.step = engine.step, lambda: (gate.wait(10), step())
    thread.start()
    thread.submit([1], SamplingParams(max_new_tokens=4),
                  lambda item: (items.append(item), isinstance(item, Ended) and ended.set()), 0.0)
    asleep = thread.sleep()              # queued behind the step that is held
    with pytest.raises(EngineAsleepError) as refused:   # refused from the call on
        thread.submit([1], SamplingParams(), lambda item: None, arrival_s=0.0)
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "5"}
    gate.set()
    assert asleep.result(10) == 4096 and engine.is_sleeping
    looks, tokens = engine.looks, len(items)
    time.sleep(0.3)                      # asleep with a request waiting: about 6 idle waits
    assert engine.looks - looks <= 10 and len(items) == tokens and thread.pending_requests == 1
    assert thread.wake_up().result(10) == 4096
    assert ended.wait(10) and items[-1] == Ended("finished")
    assert [x.event.token_id for x in items[:-1]] == [0, 1, 2, 3]   # none lost, none doubled
    assert thread.call(lambda e: e.is_sleeping).result(10) is False
    assert isinstance(thread.call(lambda e: 1 / 0).exception(10), ZeroDivisionError)
    thread.stop()
    with pytest.raises(ApiError, match="not running"):
        thread.call(lambda e: None)


def test_a_step_that_closed_the_engine_ends_every_live_request_and_stops_the_thread():
    """A tensor-parallel rank that dies closes the engine inside its step: every live request
    ends "failed" (its stream gets an error and [DONE]) though the closed engine refuses the
    abort, and the thread stops, so /health and new requests answer 503 instead of a stream
    that never ends (the thread used to die on the abort)."""
    engine = FakeEngine()
    thread = EngineThread(engine, ServeMetrics("fake"), idle_wait_s=0.01)
    ended, items = threading.Event(), []

    def rank_died():
        engine.closed = True
        engine.failed_step_request_ids = (0,)     # what the step ran: the others end too
        raise RuntimeError("rank 1: activation all_reduce failed")

    def closed_abort(request_id):
        raise RuntimeError("abort after close()")

    engine.step, engine.abort = rank_died, closed_abort
    # once both requests are live (a step before is a no-op: the second is still queued)
    engine.step = lambda: rank_died() if len(engine.live) == 2 else time.sleep(0.001)
    thread.start()
    for _ in range(2):
        thread.submit([1], SamplingParams(max_new_tokens=3), lambda item: (
            items.append(item), isinstance(item, Ended) and len(items) == 2 and ended.set()), 0.0)
    assert ended.wait(10)
    assert items == 2 * [Ended("failed", "RuntimeError: rank 1: activation all_reduce failed")]
    thread._thread.join(10)
    assert not thread.alive and thread.pending_requests == 0
    thread.stop()
