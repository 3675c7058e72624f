"""Hybrid models (full-attention layers beside windowed ones: Gemma 2, Gemma 3, Cohere2) on the
vmem per-layer cache give back, for real, the windowed layers' pages behind the window while
their tokens stay equal to transformers, under recompute preemption: the executor's pool binds
pages to each page group's FULL and WINDOW parts, and its bound pages, checked against the
manager after every step, stay below what full allocation would hold for the same sequences.

Geometry (fp32, 2 KV heads x 16): 4 KiB pages hold 32 tokens of one layer; a page group is
2 * layers pages, of which FULL = 2 (the one full layer's K and V) and WINDOW = 2 * (layers - 1).
"""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .test_window_models import prompts
from .window_families import build, hf_greedy

KiB = 1024
TPP = 32                                         # tokens per page group
HYBRID = {"gemma2": 2, "gemma3": 6, "cohere2": 2}  # label -> layers (one of them full)


def engine_for(label: str, pool_pages: int, **options) -> Engine:
    return Engine(build(label), max_batch=4, max_context=128, cache="vmem", layout="per-layer",
                  page_bytes=4 * KiB, cache_bytes=pool_pages * 4 * KiB, check_integrity=True,
                  **options)


def watch(engine) -> list:
    """After every plan the engine executes: the cache matches the manager (parts mapped under
    every slot, pages bound: ``check_matches``); returns a list that gets, per plan, the pages
    bound and the tokens its sequences attend to (cached + new: live, each held in full)."""
    kv, execute, seen = engine.kv, engine.runner.execute, []

    def checked(plan):
        out = execute(plan)
        kv.check_integrity()
        seen.append((kv.cache.mapped_pool_pages, plan.num_context_tokens))
        return out
    engine.runner.execute = checked
    return seen


def pages(layers: int) -> tuple:
    """(FULL pages, WINDOW pages) of one page group."""
    return 2, 2 * (layers - 1)


@pytest.mark.parametrize("label", list(HYBRID))
def test_one_long_sequence_holds_the_full_layers_whole_and_the_windowed_ones_near_the_window(label):
    full, window = pages(HYBRID[label])
    prompt, new = prompts(1, 20, 20, seed=5)[0], 100      # context 120: 15 windows, 4 page groups
    with engine_for(label, pool_pages=4 * (full + window)) as engine:
        seen = watch(engine)
        out = engine.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
    got, bound = out[0].outputs[0].token_ids, [b for b, _ in seen]
    peak, last = max(bound), bound[-1]
    assert got == hf_greedy(label, [prompt], new)[0]
    # the last step holds 119 tokens: FULL on all 4 pages; keys from 119 - 8 + 1 = 112 on
    # page 3 only, so WINDOW on page 3 (and at most one page more while the window straddles)
    assert last == 4 * full + window
    assert peak <= 4 * full + 2 * window < 4 * (full + window)   # full allocation: 4 groups


@pytest.mark.parametrize("mapper", [False, True], ids=["inline", "mapper"])
@pytest.mark.parametrize("label", list(HYBRID))
def test_hybrid_families_stay_exact_under_recompute_preemption_with_memory_given_back(label, mapper):
    full, window = pages(HYBRID[label])
    group = full + window
    # full allocation holds 4 groups (128 tokens in all); a recomputed 104-token prompt needs 4
    pool_pages = 4 * group + group // 2
    batch, new = prompts(4, 12, 24, seed=6), 80           # contexts up to 104: 13 windows
    with engine_for(label, pool_pages, preemption="recompute", max_tokens_per_step=16,
                    background_mapper=mapper) as engine:
        seen = watch(engine)
        out = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True))
        stats = engine.last_stats
    got = [o.outputs[0].token_ids for o in out]
    bound, live = [b for b, _ in seen], [n for _, n in seen]
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    assert got == hf_greedy(label, batch, new)
    assert max(bound) <= pool_pages
    # more tokens live at once than full allocation could ever hold in this pool
    assert max(live) > (pool_pages // group) * TPP == 128


def test_two_tensor_parallel_ranks_execute_the_part_plans_on_their_own_pools_exactly():
    """Rank 0 plans; each rank's hybrid pool (half the KV heads: half the pages) binds and
    executes the same part-op plans; the tokens are transformers'."""
    full, window = pages(HYBRID["gemma3"])
    pool_pages = 4 * (full + window) + (full + window) // 2
    batch, new = prompts(4, 12, 24, seed=6), 48
    with engine_for("gemma3", pool_pages // 2, preemption="recompute", max_tokens_per_step=16,
                    tensor_parallel_size=2) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True))
        assert engine.kv.cache.pool_pages == pool_pages // 2 == 27
        assert engine.last_stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == hf_greedy("gemma3", batch, new)
