"""Models the Engine cannot compute are refused by name at construction, before anything is
built (and with ``self_check=False`` too), instead of through the self-check:

- a window only the model's mask applies (Qwen2-MoE, PhiMoE, Doge): their attention modules
  pass no ``sliding_window`` to the attention function, so the engine's self-check tripped on
  "layer 0 attends with a sliding window of None tokens", and with ``self_check=False`` the
  first step raised mid-run;
- Doge's dynamic mask attention: a per-key bias from the values (a trained ``A``) and, past
  ``keep_window_size`` keys, a choice of the top ones; refused only by the self-check, and with
  ``self_check=False`` it answered other tokens than ``model.generate``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf import VMemCache
from vmemkv.runtime.hf.attention import UnsupportedModelError

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
QWEN2_MOE = dict(BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)
PROMPT = [(37 * i + 5) % 250 + 3 for i in range(30)]      # past the window of 8
NEW = 10
MASK_ONLY = {   # model_type -> fields that window layer 0 (8 tokens)
    "qwen2_moe": dict(QWEN2_MOE, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "phimoe": dict(BASE, sliding_window=8),
    "doge": dict(BASE, sliding_window=8),
}


def build(model_type: str, **fields):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**fields),
                                                dtype=torch.float32).eval()


def reference(model, cache=None) -> list:
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, cache=cache)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("model_type", sorted(MASK_ONLY))
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_window_only_the_mask_applies_is_refused_by_name_at_construction(model_type, cache):
    model = build(model_type, **MASK_ONLY[model_type])
    for self_check in (True, False):      # refused before the self-check runs, or any step
        with pytest.raises(UnsupportedModelError) as refused:
            Engine(model, max_batch=2, max_context=64, cache=cache, self_check=self_check)
        message = str(refused.value)
        assert f"this {model_type} config windows layer 0 (sliding_window=8)" in message
        assert "does not pass the window to the attention function" in message
        assert "self-check" not in message
    assert model.config._attn_implementation != "vmemkv"     # left on its own attention


def test_a_mask_only_window_runs_exact_through_vmem_cache_as_the_refusal_says():
    model = build("qwen2_moe", **MASK_ONLY["qwen2_moe"])
    expected = reference(model)
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=64) as cache:
        assert reference(model, cache=cache) == expected


def test_the_same_families_without_a_window_still_run_exact():
    for model_type, fields in (("qwen2_moe", QWEN2_MOE), ("phimoe", BASE), ("doge", BASE)):
        model = build(model_type, **fields)
        expected = reference(model)
        with Engine(model, max_batch=2, max_context=64) as engine:
            out = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert out[0].outputs[0].token_ids == expected, model_type


def test_doge_with_a_trained_dynamic_mask_is_refused_by_name_even_without_the_self_check():
    model = build("doge", **BASE)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.tensor([1.5, -2.0]))
    for self_check in (True, False):      # without the check it answered other tokens
        with pytest.raises(UnsupportedModelError, match="dynamic mask attention") as refused:
            Engine(model, max_batch=2, max_context=64, self_check=self_check)
        assert "per-key bias" in str(refused.value) and "doge" in str(refused.value)


def test_doge_past_keep_window_size_is_refused_naming_it_and_exact_within_it():
    model = build("doge", **dict(BASE, keep_window_size=16))
    with pytest.raises(UnsupportedModelError, match="keep_window_size=16") as refused:
        Engine(model, max_batch=2, max_context=64)
    assert "use max_context <= 16" in str(refused.value)
    short = PROMPT[:6]
    ids = torch.tensor([short])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None)[0, 6:].tolist()
    with Engine(model, max_batch=2, max_context=16) as engine:
        out = engine.generate([short], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


def test_an_undeclared_num_key_value_heads_is_not_read_as_the_caches_kv_heads():
    """ModernBERT-decoder's config does not declare num_key_value_heads: given one (2), the
    model still caches its 4 heads, and the engine's self-check raised a CacheStateError on a
    2-head cache (VMemCache refused the model's own writes)."""
    model = build("modernbert-decoder", **BASE)
    assert model.config.num_key_value_heads == 2        # kept as a plain attribute, unread
    expected = reference(model)
    for cache in ("vmem", "paged"):
        with Engine(model, max_batch=2, max_context=64, cache=cache) as engine:
            out = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert out[0].outputs[0].token_ids == expected, cache
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=64) as cache:
        assert cache.config.num_kv_heads == 4
        assert reference(model, cache=cache) == expected


@pytest.mark.parametrize("model_type, cache", [("qwen2_moe", "vmem"), ("qwen2_moe", "paged"),
                                               ("phimoe", "vmem"), ("doge", "paged")])
def test_a_mask_only_window_of_at_least_max_context_runs_exact_and_one_shorter_is_refused(
        model_type, cache):
    """A window of max_context tokens or more cuts nothing (keys (p - w, p] hold every
    position): a Phi-3.5-MoE config's sliding_window=131072 was refused at any max_context.
    It runs and equals model.generate; a window one token shorter is still refused by name."""
    model = build(model_type, **dict(MASK_ONLY[model_type], sliding_window=64))
    expected = reference(model)
    with Engine(model, max_batch=2, max_context=64, cache=cache) as engine:
        got = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW))[0]
    assert got.outputs[0].token_ids == expected
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=64\).*below max_context=65"):
        Engine(model, max_batch=2, max_context=65, cache=cache)
