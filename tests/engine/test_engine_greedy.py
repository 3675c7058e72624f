"""Greedy output of the engine is token-identical to transformers' own generate."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from ..vmem_only_options import options_for
from .conftest import FAMILIES, hf_greedy, model, prompts, tokens

CACHES = {
    "vmem-per-layer": dict(cache="vmem", layout="per-layer"),
    "vmem-interleaved": dict(cache="vmem", layout="interleaved"),
    "paged": dict(cache="paged", block_size=4),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_identical_to_transformers_mixed_lengths(family, cache):
    batch = prompts(5, 1, 40, seed=1)
    with Engine(model(family), max_batch=4, max_context=128, check_integrity=True,
                **CACHES[cache]) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=10))
    assert tokens(out) == hf_greedy(family, batch, 10)
    assert all(o.finished for o in out)


def test_greedy_identical_with_chunked_prefill():
    # a step budget smaller than the prompts: prefill runs in chunks across steps
    batch = prompts(4, 20, 40, seed=2)
    with Engine(model(), max_batch=4, max_context=128, max_tokens_per_step=8) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=8))
    assert tokens(out) == hf_greedy("tiny-llama", batch, 8)


def test_greedy_identical_with_background_mapper():
    batch = prompts(4, 5, 40, seed=3)
    with Engine(model(), max_batch=4, max_context=128, page_bytes=4096,
                background_mapper=True) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=12))
        assert engine.last_stats.mapping_s > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 12)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_prefix_sharing_on_identical_prompts_match_transformers(cache):
    # simple cases only: identical prompts and a shared 32-token prefix (whole pages / blocks);
    # a 32-token step budget admits one prompt per step, so later ones hit what earlier computed
    base = prompts(1, 32, 32, seed=4)[0]
    batch = [base, base + [7, 8, 9], base, base[:16] + [1, 2, 3]]
    with Engine(model(), max_batch=4, max_context=128, cache=cache, block_size=4,
                max_tokens_per_step=32, prefix_sharing=True, check_integrity=True,
                **options_for(cache, page_bytes=4096)) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=6))
        assert engine.scheduler.gauges()["prefix_cache_hits"] > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 6)
