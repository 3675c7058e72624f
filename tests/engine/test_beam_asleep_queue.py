"""``beam_search`` on a sleeping engine raises EngineSleepingError before anything is queued,
as ``generate`` does: it queued its requests first, then raised from the step loop, so they
waited in the engine and ran after ``wake()`` with nobody to collect them."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import EngineSleepingError

from .conftest import model


def test_beam_search_while_asleep_queues_nothing():
    with Engine(model("tiny-llama"), max_batch=4, max_context=64) as engine:
        params = BeamSearchParams(beam_width=2, max_new_tokens=4)
        want = [c.token_ids for c in engine.beam_search([[1, 2, 3]], params)[0].outputs]
        engine.sleep()
        with pytest.raises(EngineSleepingError, match="call wake"):
            engine.beam_search([[1, 2, 3]], params)
        assert not engine.scheduler.has_unfinished()
        engine.wake()
        assert engine.step() == []            # nothing was left queued to run
        assert [c.token_ids for c in engine.beam_search([[1, 2, 3]], params)[0].outputs] == want
