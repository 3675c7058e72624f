"""An engine closed while asleep is closed, not asleep: every call names the close. generate,
stream, beam search and run_until_done said "the engine is asleep (sleep()): call wake() first",
and wake() then raised EngineClosedError."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import EngineClosedError
from vmemkv.runtime.models import build_model


@pytest.fixture(scope="module")
def closed_asleep():
    model = build_model("tiny-llama", seed=0)
    engine = Engine(model, max_batch=2, max_context=64, self_check=False)
    engine.sleep()
    engine.close()
    return engine


CALLS = {
    "generate": lambda e: e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)),
    "stream": lambda e: list(e.stream([[1, 2, 3]], SamplingParams(max_new_tokens=2))),
    "beam_search": lambda e: e.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2,
                                                                         max_new_tokens=2)),
    "run_until_done": lambda e: e.run_until_done(),
    "wake": lambda e: e.wake(),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_on_an_engine_closed_while_asleep_names_the_close(closed_asleep, call):
    with pytest.raises(EngineClosedError, match=r"closed|after close\(\)"):
        CALLS[call](closed_asleep)   # "after close()" or "is closed"
