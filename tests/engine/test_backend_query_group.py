"""The engine's default backend takes the model's query heads per KV head: cpu-varlen takes 64
at most, so a model of 71 query heads on one KV head (Falcon-7B's shape) got it anyway and was
refused by the self-check, naming the kernel, though sdpa runs it exactly. It now gets the
fastest backend that takes it, and gives transformers' greedy tokens."""
from __future__ import annotations

import torch

from vmemkv.runtime.attention.registry import fastest_backend
from vmemkv.runtime.engine import Engine, SamplingParams


def test_fastest_backend_skips_one_that_cannot_take_the_group():
    assert fastest_backend("vmem", "cpu", group=64) == "cpu-varlen"
    assert fastest_backend("vmem", "cpu", group=71) == "sdpa"
    assert fastest_backend("paged", "cpu", 16, group=71) == "sdpa"


def test_a_71_to_1_model_runs_exactly_on_the_default_backend():
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=71 * 8, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=71, num_key_value_heads=1,
                             head_dim=8, initializer_range=0.15)
        model = LlamaForCausalLM(config).eval()
    prompt = [5, 17, 33, 9, 120]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    with Engine(model, max_batch=2, max_context=64) as engine:
        assert engine.attention == "sdpa"
        out = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert out[0].outputs[0].token_ids == want
