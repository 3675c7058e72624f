"""Two LoRA promises the other tests leave open: a batch applied inside another gives the outer
one back when it ends (``LoraSlots.batch``: "the previous batch after"), and a fused
``qkv_proj`` (Phi-3) counts as a module that writes K/V (``LoraAdapter.kv_modules``), so an
8-bit KV cache refuses it as it refuses ``k_proj`` / ``v_proj``."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import Phi3Config, Phi3ForCausalLM

from vmemkv.runtime.lora import AdapterWeights, LoraAdapter, LoraBatch, ModuleLora, attach_lora
from vmemkv.runtime.models import build_model

Q = "model.layers.0.self_attn.q_proj"


def q_adapter(model, seed: int) -> AdapterWeights:
    linear = model.get_submodule(Q)
    g = torch.Generator().manual_seed(seed)
    lora = ModuleLora(torch.randn(2, linear.in_features, generator=g),
                      torch.randn(linear.out_features, 2, generator=g), 1.0)
    return AdapterWeights(f"q{seed}", {Q: lora})


@torch.no_grad()
def test_a_batch_applied_inside_another_gives_the_outer_one_back_when_it_ends():
    model = build_model("tiny-llama")
    slots = attach_lora(model)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    outer = LoraBatch([(0, 6, q_adapter(model, 1))])
    inner = LoraBatch([(0, 6, q_adapter(model, 2))])
    with slots.batch(outer):
        before = model(input_ids=ids).logits
        with slots.batch(inner):
            assert slots.active is inner
            assert not torch.equal(model(input_ids=ids).logits, before)
        assert slots.active is outer
        assert torch.equal(model(input_ids=ids).logits, before)
    assert slots.active is None


def test_a_fused_qkv_projection_counts_as_writing_k_and_v(tmp_path):
    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Phi3ForCausalLM(config).eval()
    tensors = {}                        # as PEFT saves a LoRA on qkv_proj and o_proj, rank 2
    for name, module in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj")):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(2, module.in_features)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, 2)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["qkv_proj", "o_proj"]}))
    adapter = LoraAdapter.load(tmp_path, model)
    fused = tuple(f"model.layers.{i}.self_attn.qkv_proj" for i in range(2))
    assert set(fused) < set(adapter.modules)
    assert adapter.kv_modules == fused
