"""Weights handed to ``LoraSlots.batch`` that do not fit the model they run on (loaded for its
fp32 twin and run on bf16, or of another width) were a raw RuntimeError from the hook's matmul
("expected m1 and m2 to have the same dtype"); they are a LoraBatchError naming the adapter,
the module and both sides' widths and dtype, and the model computes as before afterwards."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.lora import (AdapterWeights, LoraAdapter, LoraBatch, LoraBatchError,
                                 ModuleLora, attach_lora)
from vmemkv.runtime.models import build_model

from .adapters import save_adapter

IDS = torch.tensor([[3, 1, 4, 1, 5]])
Q = "model.layers.0.self_attn.q_proj"


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_weights_of_the_fp32_twin_on_a_bf16_model_are_refused_by_name(tmp_path):
    fp32 = build_model("tiny-llama", seed=0)
    path = save_adapter(fp32, tmp_path / "a", seed=5, r=2, target_modules=("q_proj",))
    weights = LoraAdapter.load(path, fp32).materialize()
    bf16 = build_model("tiny-llama", seed=0, dtype=torch.bfloat16)
    slots = attach_lora(bf16)
    before = logits(bf16)
    with pytest.raises(LoraBatchError) as info:
        with slots.batch(LoraBatch([(0, IDS.numel(), weights)])):
            logits(bf16)
    message = str(info.value)
    for word in (weights.digest[:12], Q, "torch.float32", "torch.bfloat16", "64 inputs"):
        assert word in message, (word, message)
    assert slots.active is None
    assert torch.equal(logits(bf16), before)


def test_weights_of_another_width_are_refused_naming_the_module_and_widths():
    model = build_model("tiny-llama", seed=0)
    slots = attach_lora(model)
    lora = ModuleLora(a=torch.zeros(2, 32), b=torch.zeros(64, 2), scale=1.0)   # in 32, not 64
    weights = AdapterWeights(digest="f" * 64, modules={Q: lora})
    with pytest.raises(LoraBatchError, match=r"q_proj: A \(2, 32\) and B \(64, 2\).*64 inputs "
                                             r"and 64 outputs"):
        with slots.batch(LoraBatch([(0, IDS.numel(), weights)])):
            logits(model)
