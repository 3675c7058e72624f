"""The ``prefix_cache_cached_tokens`` gauge on a hybrid model (tiny-gemma3: five windowed
layers, window 32, and one full layer) counts each cached token once: paged (six one-layer
block groups, a block of each per cached prefix block) and vmem report the same number on the
same run, and it is what a later request with the prompt hits, with the tokens of a cold run."""
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model

KiB = 1024
CACHES = {"paged": dict(cache="paged", block_size=32),
          "vmem": dict(cache="vmem", layout="per-layer", page_bytes=4096)}   # 32-token pages
PROMPT = list(range(1, 41))   # 40 tokens, + 3 new: 42 computed; the 32-token window still
PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)   # reads unit 0: none released


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_cached_tokens_count_each_token_once_and_are_what_the_next_request_hits(cache):
    with Engine(model("tiny-gemma3"), cache_bytes=128 * KiB, max_context=256, prefix_sharing=True,
                prefix_eviction="lru", self_check=True, **CACHES[cache]) as engine:
        cold = engine.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
        cached = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        warm = engine.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
        hits = engine.last_stats.prefix_cache_hits
    assert cached == 32 == hits      # one whole 32-token unit (paged before: 6 x 32 = 192)
    assert warm == cold


def test_vmem_caches_only_what_a_later_request_can_hit_once_the_window_passed_page_zero():
    """A 70-token prompt (+ 3: 72 computed) slides the window past page 0 (70 - 32 + 1 = 39),
    which can no longer serve a hit, so its page 1 cannot be reached either: nothing is cached
    (before: 32 tokens, that page) and the same request again hits nothing, with the same
    tokens. Its first 40 tokens then (the window still reading page 0) register page 0: the
    gauge is 32, and the next such request hits exactly those 32, with the tokens of the run
    that computed them."""
    long_prompt = list(range(1, 71))
    with Engine(model("tiny-gemma3"), cache_bytes=384 * KiB, max_context=256, prefix_sharing=True,
                prefix_eviction="lru", self_check=True, **CACHES["vmem"]) as engine:
        def run(prompt):
            tokens = engine.generate([prompt], PARAMS)[0].outputs[0].token_ids
            return (tokens, engine.last_stats.prefix_cache_hits,
                    engine.scheduler.gauges()["prefix_cache_cached_tokens"])
        first, _, cached_after_first = run(long_prompt)
        again, hits_again, cached_after_again = run(long_prompt)
        short, hits_short, cached_after_short = run(PROMPT)
        warm, hits_warm, _ = run(PROMPT)
    assert cached_after_first == 0 == hits_again == cached_after_again
    assert again == first
    assert hits_short == 0 and cached_after_short == 32 == hits_warm
    assert warm == short
