"""Under memory pressure: preempted requests (recompute and swap) resume and still produce
transformers' exact greedy tokens; nothing is lost; what can never fit is rejected up front."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, RequestRejectedError, SamplingParams

from .conftest import FAMILIES, hf_greedy, model, prompts, tokens

KiB = 1024
# tiny models: 2 layers x 2 kv heads x 16 dims fp32 = 128 B per token, layer and K (or V)
TIGHT = {
    "vmem-per-layer": dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB,    # 32 tok/page
                           cache_bytes=64 * KiB),                                 # 4 groups
    "vmem-interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4 * KiB,  # 16 tok/page
                             cache_bytes=48 * KiB),                                   # 6 groups
    "paged": dict(cache="paged", block_size=4, cache_bytes=48 * KiB),              # 24 blocks
}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("cache", list(TIGHT))
def test_preempted_requests_resume_token_identical(cache, preemption):
    batch = prompts(6, 8, 30, seed=5)
    swap = dict(swap_bytes=1 << 20) if preemption == "swap" else {}
    with Engine(model(), max_batch=4, max_context=64, preemption=preemption,
                check_integrity=True, **TIGHT[cache], **swap) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=24, ignore_eos=True))
        stats = engine.last_stats
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    if preemption == "swap":
        assert stats.num_swap_preemptions > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 24, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_second_family_survives_preemption(family):
    batch = prompts(5, 8, 30, seed=6)
    with Engine(model(family), max_batch=4, max_context=64, **TIGHT["paged"]) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=20))
        assert engine.last_stats.num_preemptions > 0
    assert tokens(out) == hf_greedy(family, batch, 20)


@pytest.mark.parametrize("cache", ["vmem-per-layer", "paged"])
def test_nothing_lost_under_memory_pressure(cache):
    batch = prompts(16, 1, 30, seed=7)
    lengths = [1 + (i * 7) % 30 for i in range(len(batch))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    with Engine(model(), max_batch=4, max_context=64, check_integrity=True, **TIGHT[cache]) as engine:
        out = engine.generate(batch, params)
        assert not engine.has_unfinished()
        assert engine.last_stats.requests == len(batch)
    assert [len(o.outputs[0].token_ids) for o in out] == lengths
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_request_that_can_never_fit_is_rejected_before_anything_runs():
    with Engine(model(), max_batch=4, max_context=64, **TIGHT["paged"]) as engine:
        fine, huge = [1, 2, 3], list(range(60))
        with pytest.raises(RequestRejectedError) as info:
            engine.generate([fine, huge], SamplingParams(max_new_tokens=10))
        assert info.value.index == 1
        assert not engine.has_unfinished()          # the fine one was not queued either
        with pytest.raises(RequestRejectedError):
            engine.add_request([], SamplingParams())
        with pytest.raises(RequestRejectedError):
            engine.add_request([1, 10_000], SamplingParams())
        assert not engine.has_unfinished()
        out = engine.generate([fine], SamplingParams(max_new_tokens=4))   # still usable
        assert len(out[0].outputs[0].token_ids) <= 4


@pytest.mark.parametrize("cache", ["vmem-per-layer", "paged"])
def test_prefix_sharing_under_preemption_and_chunked_prefill_stays_exact(cache):
    """Prefix sharing, chunked prefill and preemption together stay token-exact. (The unit
    test of the managers' withdrawal of uncomputed blocks is in tests/scheduler.)"""
    base = prompts(1, 40, 40, seed=8)[0]
    batch = [base[: 8 + 4 * i] + p for i, p in enumerate(prompts(8, 1, 12, seed=9))]
    with Engine(model(), max_batch=4, max_context=64, prefix_sharing=True, check_integrity=True,
                max_tokens_per_step=8, **TIGHT[cache]) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=16, ignore_eos=True))
        gauges = engine.scheduler.gauges()
        assert engine.last_stats.num_preemptions > 0
    assert gauges["prefix_cache_hits"] > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 16, ignore_eos=True)
