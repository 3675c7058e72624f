"""``Engine.reset_prefix_cache`` (vLLM's): every prefix-cache entry no live request holds is
evicted, so the next turn computes its whole prompt again (a benchmark's cold start), with the
same tokens; what a live request holds stays its own and stays findable; the manager and the
cache agree after it; it returns the cached tokens evicted."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, EngineClosedError, SamplingParams

from .conftest import model, prompts, tokens

CACHES = {"vmem": dict(cache="vmem", page_bytes=4096), "paged": dict(cache="paged", block_size=4)}
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
SYSTEM = prompts(1, 24, 24, seed=11)[0]


def engine_for(cache, **options):
    return Engine(model(), max_batch=4, max_context=128, prefix_sharing=True,
                  prefix_eviction="lru", check_integrity=True, **CACHES[cache], **options)


@pytest.mark.parametrize("cache", list(CACHES))
def test_after_a_reset_the_same_prompts_hit_nothing_and_give_the_same_tokens(cache):
    batch = [SYSTEM + q for q in prompts(3, 9, 20, seed=12)]
    with engine_for(cache) as engine:
        first = tokens(engine.generate(batch, PARAMS))
        cached = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        assert cached > 0
        warm = tokens(engine.generate(batch, PARAMS))
        assert engine.last_stats.prefix_cache_hits > 0
        before = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        assert engine.reset_prefix_cache() == before > 0
        assert engine.scheduler.gauges()["prefix_cache_cached_tokens"] == 0
        engine.kv.manager.check_integrity()
        engine.kv.check_integrity()
        cold = tokens(engine.generate(batch, PARAMS))
        assert engine.last_stats.prefix_cache_hits == 0
        assert engine.reset_prefix_cache() > 0       # the cold run cached again
        assert engine.reset_prefix_cache() == 0      # nothing left
    assert first == warm == cold


@pytest.mark.parametrize("cache", list(CACHES))
def test_what_a_live_request_holds_stays_findable(cache):
    prompt = SYSTEM + prompts(1, 12, 12, seed=5)[0]
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    with engine_for(cache) as engine:
        want = tokens(engine.generate([prompt], long))
        engine.reset_prefix_cache()
        rid = engine.add_request(prompt, long)
        for _ in range(3):
            engine.step()                        # its prompt computed and published
        assert engine.reset_prefix_cache() == 0  # all of it held: nothing evicted
        hits = engine.kv.manager.prefix_hits
        twin = engine.add_request(prompt, PARAMS)
        engine.run_until_done()
        assert engine.kv.manager.prefix_hits - hits >= len(SYSTEM)   # the twin hit what rid holds
        assert engine.output(rid).outputs[0].token_ids == want[0]
        engine.kv.manager.check_integrity()
        engine.kv.check_integrity()
        assert engine.output(twin).status == "finished"


def test_without_prefix_sharing_it_evicts_nothing_and_after_close_it_is_refused():
    engine = Engine(model(), max_batch=2, max_context=64, cache="vmem")
    engine.generate([SYSTEM], PARAMS)
    assert engine.reset_prefix_cache() == 0
    engine.close()
    with pytest.raises(EngineClosedError, match="reset_prefix_cache after close"):
        engine.reset_prefix_cache()
