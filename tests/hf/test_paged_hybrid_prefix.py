"""Prefix hits on paged hybrids (Gemma 2, Gemma 3 and Cohere2 patterns, window 8, blocks of 4):
the same shared-system-prompt batch run twice on one engine hits what the first pass computed
(every block group: the full groups' blocks of the hit, the windowed groups' blocks of the
window before its end) and still gives transformers' greedy tokens."""
from __future__ import annotations

import random

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .window_families import build, hf_greedy

NEW = 10


@pytest.mark.parametrize("label", ["gemma2", "gemma3", "cohere2"])
def test_a_paged_hybrid_serves_a_shared_system_prompt_from_its_cache(label):
    rng = random.Random(5)
    system = [rng.randrange(3, 256) for _ in range(22)]     # 5 whole blocks and 2 tokens
    batch = [system + [rng.randrange(3, 256) for _ in range(n)] for n in (3, 6, 9)]
    want = hf_greedy(label, batch, NEW)
    with Engine(build(label), max_batch=4, max_context=64, check_integrity=True, cache="paged",
                block_size=4, prefix_sharing=True, max_tokens_per_step=32) as engine:
        assert len(engine.kv.manager.layout().block_groups) > 1
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        first = engine.generate(batch, params)
        second = engine.generate(batch, params)
        hits = engine.last_stats.prefix_cache_hits
    assert hits > 0
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in second] == want
