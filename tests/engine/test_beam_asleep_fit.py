"""A beam search added while the engine is asleep is checked against the pool it wakes to, as
awake: one that could never run there is refused at add (RequestRejectedError, nothing queued)
where it had been accepted and then failed after wake() 'cannot grow'."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from .conftest import model

OPTIONS = dict(cache="vmem", layout="per-layer", page_bytes=4096, max_batch=4,
               max_context=128, cache_bytes=48 * 1024)
PROMPT = list(range(3, 36))      # 33 tokens: 3 beams hold 16 pages at 38 tokens, the pool 12


def refusal(engine, params):
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_beam_request(PROMPT, params)
    return str(refused.value)


def test_a_beam_search_added_asleep_is_refused_as_awake_and_nothing_is_queued():
    params = BeamSearchParams(3, max_new_tokens=6, ignore_eos=True)
    with Engine(model("tiny-llama"), **OPTIONS) as engine:
        awake = refusal(engine, params)
        assert engine.sleep() == 48 * 1024
        asleep = refusal(engine, params)
        assert not engine.scheduler.has_unfinished()
        assert engine.wake() == 48 * 1024
        assert not engine.scheduler.has_unfinished()
    assert "holds at least 16 pages at 38 tokens" in awake
    assert "more than the cache's 12 pages" in awake
    assert asleep == awake + " (the size it wakes to; it is asleep)"


def test_a_beam_search_that_fits_is_still_accepted_asleep_and_finishes_after_wake():
    params = BeamSearchParams(2, max_new_tokens=2, ignore_eos=True)
    with Engine(model("tiny-llama"), **OPTIONS) as engine:
        engine.sleep()
        rid = engine.add_beam_request(PROMPT[:8], params)
        engine.wake()
        engine.run_until_done()
        out = engine.output(rid)
    assert out.status == "finished" and [len(c.token_ids) for c in out.outputs] == [2, 2]
