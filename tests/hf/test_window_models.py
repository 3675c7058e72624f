"""Sliding-window and hybrid families run through Engine and VMemCache with transformers'
exact greedy tokens, on contexts five to seven windows long (window 8), with preemption, on
vmem (per-layer) and paged; and the refusals of what cannot be computed exactly."""
from __future__ import annotations

import random

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf.attention import UnsupportedModelError
from vmemkv.runtime.hf.support import layer_windows_of

from .window_families import WINDOW, WINDOW_FAMILIES, build, hf_greedy, vmem_cache_greedy

KiB = 1024
LONG = 24     # new tokens: with prompts up to 30, contexts reach 54 (7 windows of 8)
CACHES = {"vmem": dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB),
          "paged": dict(cache="paged", block_size=4)}


def prompts(count: int, low: int, high: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def run(label: str, batch, new_tokens: int, **engine_kwargs):
    with Engine(build(label), max_batch=4, max_context=64, check_integrity=True,
                **engine_kwargs) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        stats = engine.last_stats
    return [o.outputs[0].token_ids for o in out], stats


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("label", list(WINDOW_FAMILIES))
def test_windowed_family_is_greedy_exact_over_several_windows(label, cache):
    batch = prompts(3, 5, 30, seed=1)
    got, _ = run(label, batch, LONG, **CACHES[cache])
    assert got == hf_greedy(label, batch, LONG)


@pytest.mark.parametrize("label", ["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_windowed_family_stays_exact_under_preemption(label, cache, preemption):
    # Mistral on paged gives back every block behind its window, so it needs a far smaller
    # cache (and prompts that fit it whole: admission allocates a prompt at full size) to be
    # preempted; on vmem its slots (one per page group) still run out
    short = label == "mistral" and cache == "paged"
    batch = prompts(6, 4, 8, seed=2) if short else prompts(6, 8, 30, seed=2)
    size_kib = 16 if short else 96 if label == "gemma3" else 32
    tight = dict(cache_bytes=size_kib * KiB, preemption=preemption, max_tokens_per_step=16)
    if preemption == "swap":
        tight["swap_bytes"] = 1 << 20
    got, stats = run(label, batch, LONG, **CACHES[cache], **tight)
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    assert got == hf_greedy(label, batch, LONG)


@pytest.mark.parametrize("label", list(WINDOW_FAMILIES))
def test_windowed_family_through_vmem_cache_generate_is_exact(label):
    prompt = prompts(1, 20, 20, seed=3)[0]
    assert vmem_cache_greedy(label, prompt, 30) == hf_greedy(label, [prompt], 30)[0]


def test_layer_windows_follow_transformers_layer_types():
    assert layer_windows_of(build("mistral").config) == (WINDOW, WINDOW)
    assert layer_windows_of(build("qwen2").config) == (None, WINDOW)
    assert layer_windows_of(build("gemma2").config) == (WINDOW, None)
    assert layer_windows_of(build("gemma3").config) == (WINDOW,) * 5 + (None,)
    from transformers import MistralConfig, Qwen2Config
    assert layer_windows_of(MistralConfig(num_hidden_layers=3, sliding_window=None)) == (None,) * 3
    assert layer_windows_of(Qwen2Config(num_hidden_layers=2, sliding_window=8)) == (None, None)


def test_the_engine_cache_carries_the_models_windows():
    with Engine(build("gemma3"), max_batch=2, max_context=64) as engine:
        assert engine.cache.config.layer_windows == (WINDOW,) * 5 + (None,)


# ---- refusals: named, before anything is built ----------------------------------------------
def _model(model_type: str, **fields):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from .families import BASE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**dict(BASE, **fields)))


REFUSED = [
    ("attention sinks", "gpt_oss", dict(head_dim=16, sliding_window=8, num_local_experts=4,
                                        num_experts_per_tok=2), "attention sinks"),
    ("chunked attention", "llama4_text", dict(head_dim=16, attention_chunk_size=4,
                                              num_local_experts=2), "chunked"),
    ("bidirectional", "gemma3_text", dict(head_dim=16, use_bidirectional_attention=True),
     "bidirectional attention"),
]


@pytest.mark.parametrize("model_type,fields,words", [pytest.param(*c[1:], id=c[0]) for c in REFUSED])
def test_what_cannot_be_computed_exactly_is_refused_by_name(model_type, fields, words):
    with pytest.raises(UnsupportedModelError, match=words):
        Engine(_model(model_type, **fields), max_batch=2, max_context=64)
