"""A resize is checked against a live beam request by the rule ``add_request`` checks it by
(``beam_fit.check_beam_group_fits``: the group at the lengths it surely reaches), and that rule
counts the pool as it is now. Before, ``resize_cache(32 KiB, preempt=True)`` was accepted with a
2-beam search of a 26-token prompt and 15 new tokens waiting (checked one sequence at a time,
and as its group would come back at its current length), and the search then ended 'failed':
"sequence 30 (33 tokens, one of the 2 beams ...) cannot grow in a cache of 64 tokens"; the same
search added to the engine after that shrink was accepted too (the rule counted the pool as it
was built, 40 pages) and failed the same way. The group holds at least 12 pages at 40 tokens;
32 KiB of 4 KiB pages is 8, 48 KiB is 12."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import CacheShrunkRequestError, Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import engine_state, model, prompts

KiB = 1024
PROMPT = prompts(4, 5, 30, seed=2)[3]            # 26 tokens
BEAMS = BeamSearchParams(beam_width=2, max_new_tokens=15, ignore_eos=True)
REFUSED = (r"resizing the cache to 32768 bytes: request 0: a beam search of 2 beams over a "
           r"26-token prompt holds at least 12 pages at 40 tokens .* more than the cache's 8 "
           r"pages at its current size; resized back up it holds 80")


def _engine() -> Engine:
    return Engine(model(), max_batch=8, max_context=96, layout="per-layer", page_bytes=4 * KiB,
                  cache_bytes=160 * KiB, max_cache_bytes=320 * KiB)


def _beams(engine: Engine, request_id: int) -> list:
    engine.run_until_done()
    out = engine.output(request_id)
    assert out.status == "finished", out.error
    return [list(c.token_ids) for c in out.outputs]


@pytest.fixture(scope="module")
def reference() -> list:
    """The search's beams on the engine no resize touches."""
    assert len(PROMPT) == 26
    with _engine() as engine:
        return _beams(engine, engine.add_beam_request(PROMPT, BEAMS))


@pytest.mark.parametrize("steps", [0, 2], ids=["waiting", "running"])
def test_a_shrink_that_would_strand_a_beam_search_is_refused_and_it_finishes(reference, steps):
    with _engine() as engine:
        rid = engine.add_beam_request(PROMPT, BEAMS)
        for _ in range(steps):
            engine.step()
        assert engine.status(rid) == ("waiting" if steps == 0 else "running")
        before = engine_state(engine)
        with pytest.raises(CacheResizeError, match=REFUSED):
            engine.resize_cache(32 * KiB, preempt=True)   # (what it holds now fits 8 pages)
        assert engine_state(engine) == before and engine.cache_bytes == 160 * KiB
        assert engine.scheduler.metrics.num_preemptions == 0
        assert _beams(engine, rid) == reference


def test_a_shrink_that_leaves_the_search_its_twelve_pages_is_accepted(reference):
    with _engine() as engine:
        rid = engine.add_beam_request(PROMPT, BEAMS)
        assert engine.resize_cache(48 * KiB, preempt=True) == 48 * KiB
        assert _beams(engine, rid) == reference


def test_a_beam_search_added_after_a_shrink_is_refused_until_the_cache_grows(reference):
    with _engine() as engine:
        assert engine.resize_cache(32 * KiB) == 32 * KiB
        with pytest.raises(CacheShrunkRequestError, match="more than the cache's 8 pages at its "
                                                          "current size; resized back up it "
                                                          "holds 80"):
            engine.add_beam_request(PROMPT, BEAMS)
        assert not engine.has_unfinished()
        assert engine.resize_cache(48 * KiB) == 48 * KiB
        assert _beams(engine, engine.add_beam_request(PROMPT, BEAMS)) == reference
