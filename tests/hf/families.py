"""Tiny random-weight configs of transformers' causal-LM families (2 layers, hidden 64), and
how each one runs through Engine and VMemCache compared with plain ``model.generate``.

Used by tests/hf/test_model_families.py, which checks docs/models.md against these results;
``python -m tests.hf.families`` prints the table (paste it into docs/models.md).
"""
from __future__ import annotations

import warnings
from typing import Dict, Tuple

import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import RuntimeKVError
from vmemkv.runtime.hf import VMemCache

_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, **_IDS)
GPT = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
           tie_word_embeddings=False, **_IDS)
FALCON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_IDS)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MPT = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=256, **_IDS)

# family label -> (transformers model_type, config fields)
FAMILIES: Dict[str, Tuple[str, dict]] = {
    "llama": ("llama", BASE),
    "qwen2": ("qwen2", BASE),
    "qwen3": ("qwen3", dict(BASE, head_dim=16)),
    "mistral": ("mistral", BASE),
    "mixtral": ("mixtral", dict(BASE, num_local_experts=4)),
    "gemma": ("gemma", dict(BASE, head_dim=16)),
    "gemma2": ("gemma2", dict(BASE, head_dim=16)),
    "gemma3_text": ("gemma3_text", dict(BASE, head_dim=16)),
    "phi": ("phi", BASE),
    "phi3": ("phi3", BASE),
    "stablelm": ("stablelm", BASE),
    "starcoder2": ("starcoder2", BASE),
    "olmo": ("olmo", BASE),
    "olmo2": ("olmo2", BASE),
    "cohere": ("cohere", BASE),
    "cohere2 (window 8)": ("cohere2", dict(BASE, sliding_window=8)),
    "cohere2 (window 100)": ("cohere2", dict(BASE, sliding_window=100)),   # > max_context 64
    "granite": ("granite", BASE),
    "glm": ("glm", BASE),
    "smollm3": ("smollm3", BASE),
    "gpt2": ("gpt2", GPT),
    "gpt_bigcode (multi-query)": ("gpt_bigcode", GPT),
    "gptj": ("gptj", dict(GPT, rotary_dim=8)),
    "gpt_neox": ("gpt_neox", dict(BASE, num_key_value_heads=None)),
    "opt": ("opt", dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=256,
                        word_embed_proj_dim=64, pad_token_id=0, init_std=0.15)),
    "falcon (multi-query)": ("falcon", FALCON),
    "falcon (new decoder, ALiBi)": ("falcon", dict(FALCON, new_decoder_architecture=True,
                                                   num_kv_heads=2, alibi=True)),
    "bloom": ("bloom", dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, **_IDS)),
    "gpt_neo": ("gpt_neo", dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                                attention_types=[[["global", "local"], 1]], window_size=256,
                                max_position_embeddings=256, **_IDS)),
    # MptConfig defaults to use_cache=False: generate then re-feeds the whole sequence each step
    "mpt (use_cache=True)": ("mpt", dict(MPT, use_cache=True)),
    "mpt (use_cache=False, its default)": ("mpt", MPT),
    "gpt_oss": ("gpt_oss", dict(BASE, head_dim=16, sliding_window=128, **MOE,
                                layer_types=["full_attention", "full_attention"])),
    "qwen3_next": ("qwen3_next", dict(BASE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                      linear_num_value_heads=2, linear_num_key_heads=2,
                                      linear_key_head_dim=16, linear_value_head_dim=16,
                                      layer_types=["linear_attention", "full_attention"])),
    "llama4_text": ("llama4_text", dict(BASE, head_dim=16, attention_chunk_size=4, num_local_experts=2)),
    "diffllama": ("diffllama", BASE),
    "mamba": ("mamba", BASE),
    "codegen": ("codegen", dict(GPT, rotary_dim=8)),
    "ctrl": ("ctrl", GPT),
    "doge": ("doge", BASE),
    "ernie4_5": ("ernie4_5", BASE),
    "glm4": ("glm4", BASE),
    "helium": ("helium", dict(BASE, head_dim=16)),
    "olmo3": ("olmo3", BASE),
    "arcee": ("arcee", BASE),
    "bitnet": ("bitnet", BASE),
    "seed_oss": ("seed_oss", BASE),
    "persimmon": ("persimmon", dict(BASE, num_key_value_heads=None)),
    "granitemoe": ("granitemoe", BASE),
    "phimoe": ("phimoe", BASE),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(BASE, head_dim=16)),
    "cohere2": ("cohere2", BASE),
    "exaone4": ("exaone4", BASE),
    "ministral3": ("ministral3", BASE),
    "nanochat": ("nanochat", BASE),
    "jais2": ("jais2", BASE),
    "vaultgemma": ("vaultgemma", dict(BASE, head_dim=16)),
    "granite_swa": ("granite_swa", BASE),
    "jetmoe": ("jetmoe", BASE),
    "nemotron": ("nemotron", BASE),
    "minimax": ("minimax", BASE),
    "xglm": ("xglm", dict(vocab_size=256, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                          max_position_embeddings=256, **_IDS)),
    "biogpt": ("biogpt", dict(BASE, num_key_value_heads=None)),
    "gpt_neox_japanese": ("gpt_neox_japanese", dict(BASE, num_key_value_heads=None)),
    "deepseek_v3": ("deepseek_v3", dict(BASE, num_key_value_heads=4, kv_lora_rank=16,
                                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                        v_head_dim=12, moe_intermediate_size=32,
                                        n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                        topk_group=1, first_k_dense_replace=1)),
    "mimo_v2_flash": ("mimo_v2_flash", dict(BASE, head_dim=16)),
    "gemma4_text": ("gemma4_text", dict(BASE, head_dim=16, sliding_window=8)),
}

PROMPT = [5, 17, 33, 9, 41, 77, 12, 100]
NEW_TOKENS = 24     # 5 let MPT's re-fed sequence pass by coincidence (its 9th token differed)
EXACT = "exact"


def build(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    model_type, fields = FAMILIES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**fields),
                                                dtype=torch.float32).eval()


def _reference(model, ids, mask, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # no EOS: not suppressed (min_new_tokens would make generate take the runner-up where
        # the engine, ignoring EOS, samples it) and not stopping
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, **kwargs)
    return out[:, len(PROMPT):].tolist()


def outcome(family: str) -> Tuple[str, str, str]:
    """(model class, Engine result, VMemCache result): ``exact`` when the greedy tokens equal
    plain generate's, else the typed error's message. A wrong answer is returned as
    ``WRONG ...`` (never expected anywhere)."""
    model = build(family)
    ids = torch.tensor([PROMPT])
    mask = torch.ones_like(ids)
    expected = _reference(model, ids, mask)[0]
    try:
        with Engine(model, max_batch=2, max_context=64) as engine:
            out = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        got = out[0].outputs[0].token_ids
        engine_result = EXACT if got == expected else f"WRONG {got} != {expected}"
    except RuntimeKVError as error:
        engine_result = str(error)
    # VMemCache at batch 2 (rows of a batch are views of the cache that some families reshape)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    mask = torch.ones_like(ids)
    expected = _reference(model, ids, mask)
    try:
        with VMemCache.from_model_config(model.config, max_batch=2, max_context=64) as cache:
            got = _reference(model, ids, mask, cache=cache)
        cache_result = EXACT if got == expected else f"WRONG {got} != {expected}"
    except RuntimeKVError as error:
        cache_result = str(error)
    return type(model).__name__, engine_result, cache_result


# the feature a refusal names, as docs/models.md quotes it (first match wins)
FEATURES = ("self-check", "AttentionInterface", "attention sinks", "softcapping", "ALiBi",
            "sliding window", "linear_attention", "chunked_attention", "latent attention",
            "v_head_dim", "per-layer head sizes", "use_cache=False")


def cell(result: str) -> str:
    """The docs/models.md cell of one result: ``exact`` or ``refused: <feature>``."""
    if result == EXACT or result.startswith("WRONG"):
        return result
    named = [f for f in FEATURES if f.lower() in result.lower()]
    return f"refused: {named[0]}" if named else f"refused: {result[:60]}"


if __name__ == "__main__":
    import sys
    for name in sys.argv[1:] or FAMILIES:
        cls, engine, cache = outcome(name)
        print(f"| {name} | {cls} | {cell(engine)} | {cell(cache)} |")
