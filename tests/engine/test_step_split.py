"""The engine's step-time split, and greedy equality on every CPU attention backend."""
from __future__ import annotations

import pytest

from vmemkv.runtime.attention import availability
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.outputs import STEP_PHASES

from .conftest import FAMILIES, hf_greedy, model, prompts, tokens

CPU_BACKENDS = [b for b in ("sdpa", "cpu-varlen") if availability(b)]


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_step_split_fields_are_nonnegative_and_sum_to_at_most_the_step_time(cache):
    with Engine(model(), max_batch=4, max_context=128, cache=cache) as engine:
        engine.generate(prompts(6, 3, 30, seed=4), SamplingParams(max_new_tokens=6))
        stats = engine.last_stats
    phases = {p: getattr(stats, f"{p}_s") for p in STEP_PHASES}
    assert all(t >= 0 for t in phases.values()), phases
    assert phases["model"] > 0 and phases["attention"] > 0 and phases["schedule"] > 0
    assert sum(phases.values()) <= stats.step_s <= stats.wall_s
    split = stats.step_split()
    assert set(split) == set(STEP_PHASES) | {"other"}
    assert abs(sum(split.values()) - 1.0) < 1e-9
    assert 0.0 <= stats.overhead_share <= 1.0
    d = stats.as_dict()
    assert {f"{p}_s" for p in STEP_PHASES} | {"overhead_share"} <= d.keys()
    assert "step: schedule" in stats.summary()


def test_step_split_of_a_window_counts_only_its_own_steps():
    with Engine(model(), max_batch=4, max_context=128) as engine:
        engine.generate(prompts(4, 3, 20, seed=5), SamplingParams(max_new_tokens=4))
        first = engine.last_stats
        engine.generate(prompts(2, 3, 20, seed=6), SamplingParams(max_new_tokens=2))
        second, total = engine.last_stats, engine.stats()
    for p in STEP_PHASES:
        a, b, t = (getattr(s, f"{p}_s") for s in (first, second, total))
        assert 0 <= b <= t and abs(a + b - t) < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", CPU_BACKENDS)
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_greedy_identical_to_transformers_on_every_cpu_backend(family, attention, cache):
    batch = prompts(5, 1, 40, seed=1)
    with Engine(model(family), max_batch=4, max_context=128, cache=cache, attention=attention,
                max_tokens_per_step=24) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=10))
        assert engine.attention == attention
    assert tokens(out) == hf_greedy(family, batch, 10)
