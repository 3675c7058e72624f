"""The engine on a cache in another kv_cache_dtype: 2x / 4x the tokens in the same cache_bytes,
prefix hits that reproduce the tokens computed without them (one encoding, scales fixed at the
first prefill), and the refusals before anything is built."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.runtime.errors import CacheConfigError

from ..vmem_only_options import options_for
from .conftest import model, prompts, tokens

OPTIONS = dict(max_batch=4, max_context=128, block_size=4, page_bytes=4096, self_check=False)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_fp8_holds_4x_fp32s_tokens_and_bf16_2x_in_the_same_cache_bytes(cache):
    """tiny-llama is fp32: the engine's manager (what admission and preemption count) holds
    4x the tokens with fp8_e4m3 K/V and 2x with bf16, in the same cache_bytes."""
    held = {}
    for kv in ("auto", "bf16", "fp8_e4m3"):
        with Engine(model(), cache=cache, cache_bytes=2 ** 18, kv_cache_dtype=kv,
                    **options_for(cache, **OPTIONS)) as engine:
            held[kv] = engine.kv.manager.stats().total_tokens
            assert engine.cache_config.bytes_per_token * held[kv] <= 2 ** 18
    assert held["fp8_e4m3"] == 2 * held["bf16"] == 4 * held["auto"]


@pytest.mark.parametrize("cache, unit_tokens", [("vmem", 128), ("paged", 4)])
def test_prefix_hits_on_fp8_reproduce_the_tokens_computed_without_them(cache, unit_tokens):
    """A step budget of one prompt per step: later prompts hit what earlier ones computed (a
    vmem page group of fp8 holds 128 tokens of tiny-llama, so the prompts are that long)."""
    length = max(32, unit_tokens)
    base = prompts(1, length, length, seed=4)[0]
    batch = [base, base + [7, 8, 9], base]
    outs = []
    for sharing in (False, True):
        with Engine(model(), cache=cache, kv_cache_dtype="fp8_e4m3", max_tokens_per_step=length,
                    prefix_sharing=sharing, check_integrity=True,
                    **{**options_for(cache, **OPTIONS), "max_context": 2 * length + 64}) as engine:
            outs.append(tokens(engine.generate(batch, SamplingParams(max_new_tokens=6))))
            scales = engine.kv.cache.kv_scales
            assert scales.fixed == [True] * len(scales.fixed)
            if sharing:
                assert engine.scheduler.gauges()["prefix_cache_hits"] > 0
    assert outs[0] == outs[1]


def test_bad_kv_options_are_refused_before_anything_is_built():
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        Engine(model(), kv_cache_dtype="fp4", **OPTIONS)
    with pytest.raises(CacheConfigError, match=r"kv_scales\.k must have shape \[2, 2\]"):
        Engine(model(), kv_cache_dtype="int8", kv_scales=([[1.0]], [[1.0]]), **OPTIONS)


def test_a_vmemcache_in_fp8_generates_what_the_engine_in_fp8_does():
    """transformers' generate over a VMemCache storing fp8_e4m3 (its attention reads decoded
    copies) and the engine's cpu-varlen over the same encoding: same scales from the same first
    prefill, so the same greedy tokens."""
    import torch
    from vmemkv.runtime.hf.cache import VMemCache
    from .conftest import reference_model
    prompt = prompts(1, 20, 20, seed=7)[0]
    m = reference_model("tiny-llama")
    with VMemCache.from_model_config(m.config, max_batch=1, max_context=256,
                                     kv_cache_dtype="fp8_e4m3", page_bytes=4096) as cache:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = m.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8,
                             do_sample=False, eos_token_id=None)
        assert cache.kv.cache.kv_scales.fixed == [True, True]
    with Engine(model(), kv_cache_dtype="fp8_e4m3", **OPTIONS) as engine:
        ours = tokens(engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    assert ours == [out[0, len(prompt):].tolist()]
