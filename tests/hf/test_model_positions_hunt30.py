"""Position-dependent model features the engine's self-check cannot see on its own: Llama 4's
query temperature tuning (refused by name), and models whose positions end below the
self-check's 40-token prompt (a short learned position table, a dynamic-NTK threshold), which
the self-check itself must not run past."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf.attention import UnsupportedModelError

PROMPTS = [[5, 17, 33, 9, 120], [7 * i % 250 + 3 for i in range(12)],
           [(11 * i + 4) % 250 + 3 for i in range(20)]]
NEW = 10


def tiny(config_class, **fields):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM
        config = config_class(initializer_range=0.15, **fields)   # logits far apart
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def hf_greedy(model, prompts):
    out = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def engine_greedy(model, prompts, **options):
    with Engine(model, max_batch=4, **options) as engine:
        out = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def llama4(**fields):
    from transformers import Llama4TextConfig
    return tiny(Llama4TextConfig, vocab_size=256, hidden_size=64, intermediate_size=128,
                intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=2,
                attention_chunk_size=None, floor_scale=64, no_rope_layer_interval=2,
                pad_token_id=0, **fields)


def test_llama4_attention_temperature_tuning_is_refused_by_name():
    # NoPE layers scale their queries by position from floor_scale - 1 on; on the engine's
    # packed passes (no cache passed) a decode step counted position 0: a 70-token context
    # with floor_scale=64 gave other tokens than transformers, after a passing self-check
    model = llama4()
    with pytest.raises(UnsupportedModelError, match="attn_temperature_tuning=True") as refused:
        Engine(model, max_batch=2, max_context=128)
    assert "floor_scale=64" in str(refused.value)
    assert model.config._attn_implementation != "vmemkv"      # refused before the switch
    model.config.attn_temperature_tuning = False    # the layers read it when built: no effect
    with pytest.raises(UnsupportedModelError, match="attn_temperature_tuning=True"):
        Engine(model, max_batch=2, max_context=128)
    model = llama4(attn_temperature_tuning=False)                 # as the message says
    long_prompt = [[(13 * i + 5) % 250 + 3 for i in range(70)]]
    got = engine_greedy(model, long_prompt, max_context=128, cache="paged", block_size=4)
    assert got == hf_greedy(model, long_prompt)


@pytest.mark.parametrize("cache", [dict(cache="vmem", page_bytes=4096),
                                   dict(cache="paged", block_size=4)])
def test_a_dynamic_rope_threshold_below_the_self_check_prompt_runs_exact(cache):
    # max_position_embeddings=32 and max_context=32: within the threshold, so exact; the
    # self-check's 42 positions crossed it (refused, and the model's rotary state left grown)
    from transformers import LlamaConfig
    model = tiny(LlamaConfig, vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    got = engine_greedy(model, PROMPTS, max_context=32, **cache)
    assert int(model.model.rotary_emb.max_seq_len_cached) == 32     # never grown
    assert got == hf_greedy(model, PROMPTS)


def test_a_learned_position_table_shorter_than_the_self_check_prompt_runs_exact():
    # GPT-2 with 32 positions and max_context=32: the self-check's 42 positions were an
    # IndexError out of the engine's constructor
    from transformers import GPT2Config
    model = tiny(GPT2Config, vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    got = engine_greedy(model, PROMPTS, max_context=32, cache="vmem", page_bytes=4096)
    assert got == hf_greedy(model, PROMPTS)


SINUSOIDAL = {   # family -> (config class, fields): each indexes a fixed n_positions-row table
    "gptj": ("GPTJConfig", dict(rotary_dim=8)),                 # rotary sin/cos by position
    "codegen": ("CodeGenConfig", dict(rotary_dim=8)),
    "ctrl": ("CTRLConfig", dict(dff=128)),                      # sinusoidal encoding
}


@pytest.mark.parametrize("family", list(SINUSOIDAL))
def test_a_context_past_a_sinusoidal_position_table_is_refused_by_name(family):
    # n_positions=48 and max_context=64: accepted (the self-check's 42 positions fit), then a
    # sequence at position 48 was an IndexError in the middle of a step
    import transformers
    class_name, fields = SINUSOIDAL[family]
    model = tiny(getattr(transformers, class_name), vocab_size=256, n_embd=64, n_layer=2,
                 n_head=4, n_positions=48, **fields)
    with pytest.raises(UnsupportedModelError, match="exceeds the 48 positions") as refused:
        Engine(model, max_batch=2, max_context=64)
    assert "sinusoidal position table" in str(refused.value)
    assert engine_greedy(model, PROMPTS[2:], max_context=48, cache="paged",
                         block_size=4) == hf_greedy(model, PROMPTS[2:])   # within it: exact
