"""Races between the HTTP side and the engine thread, each made deterministic by holding the
engine thread (a blocking ``call``, a sink that waits, a step that waits) at the point where the
race was lost: an error answer that went out before its request's other prompts were aborted, a
queued /wake_up that re-opened a server whose /sleep was still queued, and a stop that returned
while the engine thread was still inside a step (its owner then closed the engine under it)."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
from types import SimpleNamespace

import pytest

from vmemkv.runtime.engine.outputs import RequestError
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.runtime.serve import ApiError, EngineAsleepError
from vmemkv.runtime.serve.engine_thread import Ended, EngineThread
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.submission import Submission

from .test_engine_thread import FakeEngine

FAILS_ALONE = [9]      # FailsAloneEngine: this prompt fails alone in its first step
REJECTED = [0]         # FakeEngine: this prompt is refused by add_request


class FailsAloneEngine(FakeEngine):
    """FakeEngine where a prompt FAILS_ALONE fails alone in its first step, as a request whose
    every score is -inf does (RequestRejectedError: a 400), while the others go on."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = set()

    def add_request(self, prompt, params, on_token, index=0):
        request_id = super().add_request(prompt, params, on_token, index)
        if prompt == FAILS_ALONE:
            self.failing.add(request_id)
        return request_id

    def step(self) -> None:
        for request_id in self.failing & set(self.live):
            del self.live[request_id]
            self.outputs[request_id] = SimpleNamespace(status="failed", error=RequestError(
                "RequestRejectedError", "every score is -inf", "repetition_penalty"))
        super().step()


class HeldEngineThread(EngineThread):
    """Records when an abort is asked for; ``hold_after_failure``: the engine thread waits
    for ``release`` right after it delivered a failed request's Ended."""

    def __init__(self, engine, max_pending_requests: int = 256,
                 hold_after_failure: bool = False) -> None:
        super().__init__(engine, ServeMetrics("fake"), max_pending_requests, idle_wait_s=0.01)
        self.release, self.abort_asked = threading.Event(), threading.Event()
        self._hold_after_failure = hold_after_failure

    def submit(self, prompt_ids, params, sink, arrival_s, index=0, key=None):
        def held(item) -> None:
            sink(item)
            if self._hold_after_failure and isinstance(item, Ended) and item.status == "failed":
                self.release.wait(30)
        return super().submit(prompt_ids, params, held, arrival_s, index, key)

    def abort(self, request_id: int) -> None:
        super().abort(request_id)
        self.abort_asked.set()

    def hold(self) -> None:
        """Hold the engine thread at its next command until ``release``."""
        self.call(lambda engine: self.release.wait(30))

    def running(self) -> float:
        """/metrics' running sequences (FakeEngine counts every live request running)."""
        text = self.metrics.render()
        return float(re.search(r"vmemkv:num_requests_running\{[^}]*\} (\S+)", text).group(1))


async def _answer(server: HeldEngineThread, respond):
    """(the ApiError ``respond()`` answers, requests still pending and /metrics' running
    sequences at the moment it is raised)."""
    try:
        await respond()
    except ApiError as error:
        return error, server.pending_requests, server.running()
    raise AssertionError("the request was answered without an error")


async def _answered_once_an_abort_is_asked(server: HeldEngineThread, respond):
    """``respond``'s answer; the held engine thread is released once the request has asked for
    an abort (or has answered): an answer raised before that abort ran finds it pending."""
    answer = asyncio.ensure_future(_answer(server, respond))
    while not (answer.done() or server.abort_asked.is_set()):
        await asyncio.sleep(0.001)
    server.release.set()
    return await answer


def _run(server: HeldEngineThread, test) -> tuple:
    server.start()
    try:
        return asyncio.run(test())
    finally:
        server.release.set()
        server.stop()


def _events(submission: Submission):
    async def respond() -> None:
        async for _ in submission.events():
            pass
    return respond


def test_a_prompt_that_fails_alone_is_answered_after_its_sibling_is_aborted():
    # prompt 0 fails alone (400) while prompt 1 runs on: the 400 went out before prompt 1 was
    # aborted, and the client with it still found prompt 1 in /metrics and in --max-queue
    server = HeldEngineThread(FailsAloneEngine(), hold_after_failure=True)

    async def test():
        params = SamplingParams(max_new_tokens=1000)
        submission = Submission(server, [FAILS_ALONE, [5, 6, 7]], params, 0.0)
        await submission.started()
        return await _answered_once_an_abort_is_asked(server, _events(submission))

    error, pending, running = _run(server, test)
    assert error.status == 400 and "every score is -inf" in error.message
    assert (pending, running) == (0, 0)


def test_a_prompt_the_engine_refuses_is_answered_after_its_queued_sibling_is_aborted():
    server = HeldEngineThread(FakeEngine())

    async def test():
        submission = Submission(server, [[1, 2], REJECTED], SamplingParams(max_new_tokens=1000),
                                0.0)
        server.hold()      # behind both adds: the sibling's abort waits for the release
        return await _answered_once_an_abort_is_asked(server, submission.started)

    error, pending, running = _run(server, test)
    assert error.status == 400 and "prompt 0 rejected" in error.message
    assert (pending, running) == (0, 0)


def test_a_queue_full_part_way_is_answered_after_the_prompts_queued_are_aborted():
    # --max-queue 1, two prompts: the first is queued, the second is refused (503); the 503
    # went out with the first still queued, so the client's retry found the queue full
    server = HeldEngineThread(FakeEngine(), max_pending_requests=1)

    async def test():
        server.hold()      # the first prompt stays queued until the release

        async def respond() -> None:
            submission = Submission(server, [[1, 2], [3]], SamplingParams(max_new_tokens=1000),
                                    0.0)
            await submission.started()

        answer = asyncio.ensure_future(_answer(server, respond))
        await asyncio.sleep(0)   # the answer's first turn: prompt 0 queued, prompt 1 refused
        server.release.set()
        return await answer

    error, pending, running = _run(server, test)
    assert error.status == 503 and "Retry-After" in error.headers
    assert (pending, running) == (0, 0)


def test_a_wake_up_queued_before_a_sleep_leaves_new_requests_refused():
    # /wake_up queued, then /sleep: once the wake_up ran, requests were taken again although
    # the sleep was still queued; one sent then waited asleep until some later /wake_up
    server = HeldEngineThread(FakeEngine())
    first, second = threading.Event(), threading.Event()
    server.start()
    try:
        assert server.sleep().result(30) == 4096
        server.call(lambda engine: first.wait(30))
        woken = server.wake_up()
        server.call(lambda engine: second.wait(30))   # any command between the two
        slept = server.sleep()
        first.set()
        assert woken.result(30) == 4096               # the wake_up ran; the sleep waits
        with pytest.raises(EngineAsleepError):
            server.submit([1], SamplingParams(), lambda item: None, 0.0)
        second.set()
        assert slept.result(30) == 4096
        with pytest.raises(EngineAsleepError):
            server.submit([1], SamplingParams(), lambda item: None, 0.0)
        assert server.wake_up().result(30) == 4096
        items, ended = [], threading.Event()
        server.submit([1], SamplingParams(max_new_tokens=2),
                      lambda item: (items.append(item), isinstance(item, Ended) and ended.set()),
                      0.0)
        assert ended.wait(30)        # served after the later wake_up
    finally:
        server.stop()
    assert len(items) == 3 and items[-1] == Ended("finished") and server.pending_requests == 0


class SlowStepEngine(FakeEngine):
    """FakeEngine whose steps wait for ``finish`` (a slow model's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.finish = threading.Event(), threading.Event()

    def step(self) -> None:
        self.inside.set()
        self.finish.wait(30)
        super().step()


class _Recorded(logging.Handler):
    def __init__(self, seen: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.messages, self._seen = [], seen

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())
        self._seen.set()


def test_stop_returns_only_once_the_step_under_way_has_ended_with_one_warning():
    # it gave up after a fixed 10 s join; the CLI then closed the engine under the step
    # (EngineBusyError: a traceback on SIGTERM during a long step)
    engine = SlowStepEngine()
    server = EngineThread(engine, ServeMetrics("fake"), idle_wait_s=0.01)
    ends, returned, progress = [], [], threading.Event()
    recorded = _Recorded(progress)
    logging.getLogger("vmemkv.serve").addHandler(recorded)
    try:
        server.start()
        server.submit([1], SamplingParams(max_new_tokens=5), ends.append, 0.0)
        assert engine.inside.wait(30)
        stopper = threading.Thread(target=lambda: (server.stop(0.01), returned.append(True),
                                                   progress.set()))
        stopper.start()
        assert progress.wait(30)                     # it warned, or it returned
        assert returned == [] and server.alive       # still waiting for the step
        assert recorded.messages == ["the engine thread is still inside a step 0.01 s after "
                                     "stop; waiting for the step to end before the engine may "
                                     "be closed"]
        engine.finish.set()
        stopper.join(30)
    finally:
        engine.finish.set()
        logging.getLogger("vmemkv.serve").removeHandler(recorded)
    assert returned == [True] and not server.alive
    assert ends[-1] == Ended("aborted") and server.pending_requests == 0
