"""A /sleep queued behind a step on a paged cache (which cannot sleep: Engine.resizable is
False) answered every completion sent meanwhile with 503 "the engine is asleep ... its memory is
given back", though it was then refused 409 and nothing slept (a client soak saw it 10 times)."""
from __future__ import annotations

import threading

import pytest

from vmemkv.runtime.engine import SamplingParams
from vmemkv.runtime.serve.engine_thread import Ended
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import PAGED, serving


def test_a_sleep_a_paged_cache_will_refuse_turns_no_request_away_while_it_waits():
    with serving(PAGED) as (server, engine):
        thread, release, ended = server.engine_thread, threading.Event(), threading.Event()
        thread.call(lambda _: release.wait(60))      # the engine thread is held: sleep waits
        try:
            asleep = thread.sleep()
            accepted = thread.submit([5, 17, 101], SamplingParams(max_new_tokens=2),
                                     sink=lambda item: isinstance(item, Ended) and ended.set(),
                                     arrival_s=0.0)
        finally:
            release.set()
        with pytest.raises(CacheResizeError, match="'vmem'"):
            asleep.result(60)
        assert isinstance(accepted.result(60), int) and ended.wait(60)
        assert not engine.is_sleeping and engine.resizable is False
