"""Paged hybrids (Gemma 2, Gemma 3 and Cohere2 patterns, window 8) keep one block table per
block group and give back the windowed groups' blocks behind the window: a batch whose whole
history does not fit the cache decodes past several windows without a preemption, with
transformers' greedy tokens (on main one table served every layer, so every block was held).
Preempted before a windowed group gave a block back, a paged hybrid is swapped (every group's
blocks, group after group) and comes back with the same tokens."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .test_window_models import LONG, prompts
from .window_families import build, hf_greedy

CACHE_KIB = {"gemma2": 32, "gemma3": 96, "cohere2": 32}


@pytest.mark.parametrize("label", list(CACHE_KIB))
def test_a_paged_hybrid_holds_only_the_window_of_its_windowed_groups(label):
    batch = prompts(3, 20, 30, seed=3)
    with Engine(build(label), max_batch=4, max_context=64, check_integrity=True, cache="paged",
                block_size=4, cache_bytes=CACHE_KIB[label] * 1024,
                max_tokens_per_step=16) as engine:
        manager = engine.kv.manager
        assert len(manager.layout().block_groups) > 1           # one table per block group
        history_bytes = sum(len(p) + LONG for p in batch) * manager.bytes_per_token
        assert history_bytes > CACHE_KIB[label] * 1024          # every block could not be held
        out = engine.generate(batch, SamplingParams(max_new_tokens=LONG, ignore_eos=True))
        stats = engine.last_stats
    assert stats.num_preemptions == 0
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(label, batch, LONG)


@pytest.mark.parametrize("label", ["gemma2", "gemma3"])
def test_a_paged_hybrid_swaps_out_and_back_with_transformers_tokens(label):
    # window 32 and contexts of at most 8 + 16 tokens: no block is behind the window when a
    # sequence is preempted, so each preemption is a swap of every group's blocks
    batch = prompts(6, 4, 8, seed=5)
    with Engine(build(label, window=32), max_batch=6, max_context=32, check_integrity=True,
                cache="paged", block_size=4, cache_bytes=(12 if label == "gemma2" else 36) * 1024,
                max_tokens_per_step=16, preemption="swap", swap_bytes=1 << 20) as engine:
        assert len(engine.kv.manager.layout().block_groups) > 1
        out = engine.generate(batch, SamplingParams(max_new_tokens=16, ignore_eos=True))
        stats = engine.last_stats
    assert stats.num_swap_preemptions > 0, "the cache was meant to be too small"
    assert stats.num_swap_preemptions == stats.num_preemptions
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(label, batch, 16, window=32)
