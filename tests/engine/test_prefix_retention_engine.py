"""Prefix caching across requests in the Engine (CPU, tiny model), both layouts: a second turn
whose prompt extends the first turn's hits the first turn's computed units after those requests
ended; tokens are identical with and without retention and equal to transformers; the tokens
computed fall by exactly the hit tokens."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams

from .conftest import hf_greedy, model, prompts, tokens

CACHES = {
    "vmem-per-layer": dict(cache="vmem", layout="per-layer", page_bytes=4096),
    "vmem-interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4096),
    "paged": dict(cache="paged", block_size=4),
}
NEW = 5
SYSTEM = prompts(1, 24, 24, seed=11)[0]                    # shared by every conversation


def turns():
    """Turn 1: the system prompt + a question each; turn 2: turn 1's prompt + more."""
    first = [SYSTEM + q for q in prompts(3, 9, 20, seed=12)]
    second = [p + q for p, q in zip(first, prompts(3, 3, 12, seed=13))]
    return first, second


def run(cache, eviction, salt=None):
    first, second = turns()
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, cache_salt=salt)
    with Engine(model(), max_batch=4, max_context=128, prefix_sharing=True,
                prefix_eviction=eviction, check_integrity=True, **CACHES[cache]) as engine:
        out1 = engine.generate(first, params)
        out2 = engine.generate(second, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        unit = engine.kv.manager.prefix_unit_tokens
        gauges = engine.scheduler.gauges()
    return tokens(out1) + tokens(out2), engine.last_stats, unit, gauges


@pytest.mark.parametrize("cache", list(CACHES))
def test_second_turn_hits_the_first_turns_prefix_and_computes_that_much_less(cache):
    first, second = turns()
    kept, stats_on, unit, gauges = run(cache, "lru")
    lost, stats_off, _, _ = run(cache, "off")
    assert kept == lost == hf_greedy("tiny-llama", first + second, NEW, ignore_eos=True)
    # every unit of a first-turn prompt is reused by its second turn (capped before its last token)
    expected = sum(min(len(p), len(q) - 1) // unit * unit for p, q in zip(first, second))
    assert stats_on.prefix_cache_hits == expected > 0
    assert stats_on.prefix_cache_queries == stats_off.prefix_cache_queries == sum(map(len, second))
    assert stats_off.prefix_cache_hits == 0                # the first turn's requests had ended
    assert stats_off.computed_tokens - stats_on.computed_tokens == expected
    hit_rate = expected / stats_on.prefix_cache_queries
    assert gauges["prefix_cache_hit_rate"] == pytest.approx(
        gauges["prefix_cache_hits"] / gauges["prefix_cache_queries"])
    prefill_on = stats_on.computed_tokens - stats_on.output_tokens + len(second)
    assert prefill_on == pytest.approx(stats_on.prefix_cache_queries * (1 - hit_rate))
    assert gauges["prefix_cache_cached_tokens"] > 0 and gauges["kv_cache_usage_perc"] == 0.0


def test_a_different_cache_salt_never_hits_what_the_first_turn_cached():
    _, stats, _, _ = run("paged", "lru", salt="tenant-a")   # turn 2 has no salt
    assert stats.prefix_cache_hits == 0


def test_unknown_prefix_eviction_is_an_engine_config_error():
    with pytest.raises(EngineConfigError, match="prefix_eviction must be one of off, lru, hits"):
        Engine(model(), max_batch=2, max_context=64, prefix_eviction="mru")
    with pytest.raises(EngineConfigError, match="cache_salt must be None or a non-empty str"):
        SamplingParams(cache_salt=3)
