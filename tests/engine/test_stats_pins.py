"""Pins of EngineStats' figures (a mutation audit): counters since the call's mark, the mean
K/V usage over the call's steps, a request's prompt counted once when its samples end in
different steps."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model

PLAIN = SamplingParams(max_new_tokens=3, ignore_eos=True)


def test_recomputed_tokens_count_only_the_calls_own():
    """The first call's fork finds no room (max_batch 1): 20 prompt tokens recomputed; the
    next call recomputes none, whatever the engine did before."""
    with Engine(model(), max_batch=1, max_context=64) as engine:
        engine.generate([list(range(20))], SamplingParams(
            n=2, max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True))
        assert engine.last_stats.recomputed_tokens == 20
        engine.generate([[5, 6, 7]], PLAIN)
        assert engine.last_stats.recomputed_tokens == 0
        assert engine.stats().recomputed_tokens == 20


def test_the_mean_kv_usage_is_over_the_calls_steps():
    """Two steps: the prompt and its first token held (the peak), then everything freed (0)."""
    with Engine(model(), max_batch=2, max_context=64) as engine:
        engine.generate([list(range(30))], SamplingParams(max_new_tokens=2, ignore_eos=True))
        stats = engine.last_stats
    assert stats.steps == 2 and stats.kv_usage_peak > 0
    assert stats.kv_usage_mean == stats.kv_usage_peak / 2


def test_a_prompt_is_counted_once_when_its_samples_end_in_different_steps():
    """Half the vocabulary ends a sample: with this seed sample 0 ends before sample 1 (the
    request is unfinished then; its prompt was counted at each sample's end)."""
    params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                            stop_token_ids=tuple(range(0, 256, 2)))
    with Engine(model(), max_batch=4, max_context=64) as engine:
        (out,) = engine.generate([list(range(10, 30))], params)
        stats = engine.last_stats
    lengths = [len(c.token_ids) for c in out.outputs]
    assert lengths[0] != lengths[1], f"the seed no longer ends the samples apart: {lengths}"
    assert (stats.requests, stats.prompt_tokens) == (1, 20)
