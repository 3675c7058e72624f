"""Tiny random-weight configs of the sliding-window and hybrid families (window 8 tokens, so
the tests' contexts of 40-60 tokens are five to seven windows long), and transformers' own
greedy output for them (``model.generate`` on its default cache, which for these models is a
DynamicCache with sliding-window layers, eos disabled)."""
from __future__ import annotations

import functools
import warnings

import torch

from .families import BASE

WINDOW = 8
G = dict(BASE, head_dim=16)
FULL, SLIDE = "full_attention", "sliding_attention"

# label -> (model_type, config fields); each has at least one layer windowed below the context
WINDOW_FAMILIES = {
    "mistral": ("mistral", dict(BASE, sliding_window=WINDOW)),                     # every layer
    "qwen2": ("qwen2", dict(BASE, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)),                                  # layer 1 only
    "gemma2": ("gemma2", dict(G, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                              query_pre_attn_scalar=24)),                           # local, global
    "gemma3": ("gemma3_text", dict(G, num_hidden_layers=6, sliding_window=WINDOW,
                                   query_pre_attn_scalar=24)),                      # 5 local : 1
    "cohere2": ("cohere2", dict(BASE, sliding_window=WINDOW, layer_types=[SLIDE, FULL])),
    "starcoder2": ("starcoder2", dict(BASE, sliding_window=WINDOW)),
    "phi3": ("phi3", dict(BASE, sliding_window=WINDOW)),
    "exaone4": ("exaone4", dict(BASE, sliding_window=WINDOW, layer_types=[SLIDE, FULL])),
    "olmo3": ("olmo3", dict(BASE, sliding_window=WINDOW, layer_types=[SLIDE, FULL])),
    "vaultgemma": ("vaultgemma", dict(G, sliding_window=WINDOW, attn_logit_softcapping=2.0)),
}


def gemma3n_kv_shared_config(**fields):
    """A tiny Gemma 3n: 4 layers, local and global alternating, the top 2 KV-shared (they read
    layers 0 and 1's K/V and never call update)."""
    from transformers import Gemma3nTextConfig
    return Gemma3nTextConfig(**dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=4, sliding_window=WINDOW,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
        laurel_rank=4, activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2,
        pad_token_id=0, layer_types=[SLIDE, FULL] * 2, **fields))


@functools.lru_cache(maxsize=None)
def build(label: str, window: int = WINDOW) -> torch.nn.Module:
    """The model (seed 0), built once per label and window; an Engine gives its attention back
    on close."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    model_type, fields = WINDOW_FAMILIES[label]
    fields = dict(fields, sliding_window=window)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**fields),
                                                dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _greedy(label: str, prompt: tuple, new_tokens: int, cache_kind: str,
            window: int = WINDOW) -> tuple:
    model = build(label, window)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 **_cache_kwargs(model, cache_kind))
    finally:
        model.generation_config.eos_token_id = saved
    return tuple(out[0, len(prompt):].tolist())


def _cache_kwargs(model, cache_kind: str) -> dict:
    if cache_kind == "hf":
        return {}
    from vmemkv.runtime.hf import VMemCache
    return {"past_key_values": VMemCache.from_model_config(model.config, max_batch=1,
                                                           max_context=64)}


def hf_greedy(label: str, batch, new_tokens: int, window: int = WINDOW) -> list:
    """transformers' greedy tokens per prompt (its own cache, one prompt at a time)."""
    return [list(_greedy(label, tuple(p), new_tokens, "hf", window)) for p in batch]


def vmem_cache_greedy(label: str, prompt, new_tokens: int) -> list:
    """``model.generate`` with a VMemCache as its cache (uncached: each call a new cache)."""
    return list(_greedy.__wrapped__(label, tuple(prompt), new_tokens, "vmem"))
