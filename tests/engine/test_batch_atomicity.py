"""A batch is all or nothing. Some refusals only the scheduler can make, once a prompt is added
(a beam group or an adapter that never fits beside its prompt); a batch refused at a later
prompt withdraws the earlier ones, so the engine is as if the batch had never been sent: the
refused batch's prompts never run inside the next call."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from .conftest import engine_state, model

OK = SamplingParams(max_new_tokens=4, ignore_eos=True)
SMALL = dict(cache="paged", block_size=16, max_batch=8, max_context=128, cache_bytes=512 * 64)


def refuse_at_prompt_2(engine, case: str) -> None:
    batch = [[1, 2, 3], [4, 5, 6], [7] * 40]
    if case == "beam group never fits":       # 4 beams of 48 tokens: more than the 4 blocks
        engine.beam_search(batch, BeamSearchParams(4, max_new_tokens=8, ignore_eos=True))
    elif case == "logit_bias past the vocabulary":
        engine.generate(batch, [OK, OK, SamplingParams(max_new_tokens=4, logit_bias={1000: 1.0})])
    else:
        engine.generate(batch, [OK, OK, SamplingParams(max_new_tokens=4, stop=["x"])])


@pytest.mark.parametrize("case", ["beam group never fits", "logit_bias past the vocabulary",
                                  "stop strings without a tokenizer"])
def test_a_batch_refused_at_its_last_prompt_leaves_nothing_queued(case):
    with Engine(model(), **SMALL) as engine:
        engine.generate([[8, 9]], OK)
        before = engine_state(engine)
        with pytest.raises(RequestRejectedError, match="prompt 2"):
            refuse_at_prompt_2(engine, case)
        assert engine_state(engine) == before and not engine.has_unfinished()
        out = engine.generate([[9, 9]], OK)
        assert len(out) == 1 and engine.last_stats.prompt_tokens == 2
        assert engine.scheduler.metrics.num_finished_requests == 2   # nothing else ran
