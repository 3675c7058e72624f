"""A ``sliding_window`` passed to a config whose class does not declare it: transformers' model
code builds no windowed mask from it, yet OLMoE still hands it to the attention function, so
the engine windowed where ``model.generate`` attended to every token (past a self-check too
short to see a window of 48). Refused by name; without the field the model runs exact."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf.attention import UnsupportedModelError

NEW = 12


def olmoe(**fields):
    from transformers import AutoModelForCausalLM, OlmoeConfig
    config = OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, initializer_range=0.15,
                         pad_token_id=0, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_an_undeclared_sliding_window_is_refused_by_name_and_runs_exact_without_it():
    model = olmoe(sliding_window=48)
    prompt = [(13 * i + 5) % 250 + 3 for i in range(70)]        # past the window
    with pytest.raises(UnsupportedModelError, match="sliding_window=48") as refused:
        Engine(model, max_batch=2, max_context=128)
    assert "OlmoeConfig does not declare" in str(refused.value)
    del model.config.sliding_window                              # as the message says
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    with Engine(model, max_batch=2, max_context=128, cache="paged", block_size=4) as engine:
        out = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ids[0, len(prompt):].tolist()
