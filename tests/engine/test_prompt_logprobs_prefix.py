"""A request asking for prompt logprobs skips the prefix-cache lookup (as vLLM v1): every prompt
row is computed and scored, no prefix query is counted, and its computed full blocks are still
cached under the scope every request uses, so a later plain request with that prompt hits them."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model, prompts

CONFIGS = {"paged": (dict(cache="paged", block_size=4), 36),            # 9 blocks (never token 40)
           "vmem": (dict(cache="vmem", layout="per-layer", page_bytes=4096, block_size=4), 36)}


def scored(out) -> list:
    return [None if e is None else (e.token_id, e.logprob, e.rank, e.top) for e in out.prompt_logprobs]


@pytest.mark.parametrize("kind", CONFIGS)
def test_prompt_logprobs_skip_the_lookup_but_publish_for_later_requests(kind):
    options, full_tokens = CONFIGS[kind]
    prompt = prompts(1, 40, 40, seed=71)[0]
    asking = SamplingParams(max_new_tokens=2, prompt_logprobs=2, ignore_eos=True)
    plain = SamplingParams(max_new_tokens=2, ignore_eos=True)
    with Engine(model(), max_batch=2, max_context=64, **options) as engine:   # no prefix cache
        reference = scored(engine.generate([prompt], asking)[0])
    with Engine(model(), max_batch=2, max_context=64, prefix_sharing=True, **options) as engine:
        first = engine.generate([prompt], asking)[0]
        stats = engine.last_stats
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)  # (was 40 queried)
        assert engine.scheduler.gauges()["prefix_cache_queries"] == 0
        engine.generate([prompt], plain)               # its blocks were cached for this one
        assert (engine.last_stats.prefix_cache_queries,
                engine.last_stats.prefix_cache_hits) == (40, full_tokens)        # (was 0 hits)
        again = engine.generate([prompt], asking)[0]   # cached now: still computed in full
        assert (engine.last_stats.prefix_cache_queries, engine.last_stats.prefix_cache_hits) == (0, 0)
    assert len(reference) == 40 and reference[0] is None
    assert scored(first) == reference and scored(again) == reference
