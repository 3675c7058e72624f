"""LoRA inside the HF forward: a batch mixing adapters and base rows gives, per sequence, PEFT's
merged model's logits; without a batch the model is the base model, bitwise."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict

import pytest
import torch

from vmemkv.runtime.lora import (AdapterWeights, LoraAdapter, LoraBatch, LoraBatchError,
                                 ModuleLora, attach_lora, supported_modules)
from vmemkv.runtime.models import build_model

from .adapters import ATTENTION, MLP, merged_model, save_adapter

SEQ_LEN = 12
# rank 4 on attention, rank 8 rsLoRA on attention + MLP, rank 16 on the MLP
ADAPTERS = {
    "attn-r4": dict(seed=1, r=4, lora_alpha=8, target_modules=ATTENTION),
    "all-r8-rslora": dict(seed=2, r=8, lora_alpha=16, use_rslora=True, target_modules=ATTENTION + MLP),
    "mlp-r16": dict(seed=3, r=16, lora_alpha=32, target_modules=MLP),
}


@dataclass
class Family:
    base: torch.nn.Module
    model: torch.nn.Module                     # a copy of base with attach_lora
    adapters: Dict[str, LoraAdapter]
    references: Dict[str, torch.nn.Module]     # PEFT's merged models


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def family(request, tmp_path_factory):
    base = build_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    paths = {name: save_adapter(base, directory / name, **spec) for name, spec in ADAPTERS.items()}
    model = copy.deepcopy(base)
    attach_lora(model)
    return Family(base, model, {name: LoraAdapter.load(path, model) for name, path in paths.items()},
                  {name: merged_model(base, path) for name, path in paths.items()})


def pack_all(adapters):
    """Every adapter packed into one shared buffer, back to back (as in pool pages)."""
    buffer = torch.zeros(sum(a.num_bytes for a in adapters.values()), dtype=torch.uint8)
    weights, offset_bytes = {}, 0
    for name, adapter in adapters.items():
        region = buffer[offset_bytes:offset_bytes + adapter.num_bytes]
        adapter.pack_into(region)
        weights[name] = adapter.views(region)
        offset_bytes += adapter.num_bytes
    return weights


@torch.no_grad()
def test_mixed_adapter_batch_matches_peft_per_sequence(family):
    # rows: five sequences flattened; "attn-r4" runs two of them apart (an index path, not a slice)
    chosen = ["attn-r4", None, "all-r8-rslora", "attn-r4", "mlp-r16"]
    ids = torch.randint(0, 256, (len(chosen), SEQ_LEN), generator=torch.Generator().manual_seed(0))
    weights = pack_all(family.adapters)
    segments = [(i * SEQ_LEN, (i + 1) * SEQ_LEN, weights[name] if name else None)
                for i, name in enumerate(chosen)]
    with attach_lora(family.model).batch(LoraBatch(segments)):
        logits = family.model(input_ids=ids).logits
    base = family.base(input_ids=ids).logits
    for i, name in enumerate(chosen):
        expected = family.references[name](input_ids=ids[i:i + 1]).logits[0] if name else base[i]
        if name:
            assert (expected - base[i]).abs().max() > 0.1, "the adapter must change the logits"
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=0)
        assert torch.equal(logits[i].argmax(-1), expected.argmax(-1))


@torch.no_grad()
def test_no_batch_is_the_base_model_bitwise(family):
    ids = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    base = family.base(input_ids=ids).logits
    assert torch.equal(family.model(input_ids=ids).logits, base)
    with attach_lora(family.model).batch(LoraBatch([(0, 2 * SEQ_LEN, None)])):
        assert torch.equal(family.model(input_ids=ids).logits, base)


def test_attach_is_idempotent_and_hooks_every_projection_once():
    model = build_model("tiny-llama")
    slots = attach_lora(model)
    assert attach_lora(model) is slots
    assert slots.modules == supported_modules(model)
    assert len(slots.modules) == 2 * 7          # 2 layers x (4 attention + 3 MLP projections)
    for name in slots.modules:
        assert len(model.get_submodule(name)._forward_hooks) == 1
    assert all(".layers." in name for name in slots.modules)


def _random_lora(linear, rank, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return ModuleLora(torch.randn(rank, linear.in_features, generator=g),
                      torch.randn(linear.out_features, rank, generator=g), scale)


@torch.no_grad()
@pytest.mark.parametrize("leading", [(), (1,)])
def test_mixed_rows_through_one_projection_equal_per_row(leading):
    model = build_model("tiny-qwen2")                      # q_proj has a bias
    name = "model.layers.1.self_attn.q_proj"
    linear = model.get_submodule(name)
    slots = attach_lora(model)
    a = AdapterWeights("a", {name: _random_lora(linear, 4, 0, 0.5)})
    b = AdapterWeights("b", {name: _random_lora(linear, 8, 1, 2.0)})
    no_q = AdapterWeights("c", {"model.layers.0.mlp.up_proj": _random_lora(model.get_submodule(
        "model.layers.0.mlp.up_proj"), 2, 2, 1.0)})
    segments = [(0, 3, a), (3, 5, None), (5, 6, b), (6, 9, a), (9, 11, no_q), (11, 12, a),
                (12, 14, a), (15, 17, b)]              # row 14 in no segment; (11, 12)+(12, 14) adjacent
    x = torch.randn(*leading, 17, linear.in_features, generator=torch.Generator().manual_seed(3))
    with slots.batch(LoraBatch(segments)):
        out = linear(x).reshape(17, -1)
    x_rows = x.reshape(17, -1)
    base = torch.nn.functional.linear(x_rows, linear.weight, linear.bias)
    expected = base.clone()
    for start, end, weights in segments:
        lora = weights.modules.get(name) if weights else None
        if lora:
            expected[start:end] += lora.scale * (x_rows[start:end] @ lora.a.T) @ lora.b.T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    base_rows = [3, 4, 9, 10, 14]
    assert torch.equal(out[base_rows], base[base_rows])


def test_batch_refuses_overlap_rows_past_the_step_and_unknown_modules():
    model = build_model("tiny-llama")
    slots = attach_lora(model)
    name = "model.layers.0.self_attn.q_proj"
    w = AdapterWeights("w", {name: _random_lora(model.get_submodule(name), 2, 0, 1.0)})
    with pytest.raises(LoraBatchError, match="overlap"):
        LoraBatch([(0, 4, w), (3, 6, None)])
    with pytest.raises(LoraBatchError, match="row_start"):
        LoraBatch([(5, 4, w)])
    with pytest.raises(LoraBatchError, match="AdapterWeights"):
        LoraBatch([(0, 4, "w")])
    with slots.batch(LoraBatch([(0, 40, w)])), pytest.raises(LoraBatchError, match="40"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    stray = AdapterWeights("s", {"lm_head": w.modules[name]})
    with pytest.raises(LoraBatchError, match="lm_head"):
        with slots.batch(LoraBatch([(0, 4, stray)])):
            pass
    assert slots.active is None


@torch.no_grad()
def test_rank_and_alpha_patterns_match_peft(tmp_path):
    base = build_model("tiny-llama")
    path = save_adapter(base, tmp_path / "patterns", seed=4, r=4, lora_alpha=8,
                        target_modules=ATTENTION, rank_pattern={"q_proj": 8},
                        alpha_pattern={"layers.1.self_attn.v_proj": 32})
    model = copy.deepcopy(base)
    adapter = LoraAdapter.load(path, model)
    assert adapter.layout.slots["model.layers.0.self_attn.q_proj"][0].shape == (8, 64)
    assert adapter.scales["model.layers.0.self_attn.q_proj"] == 8 / 8
    assert adapter.scales["model.layers.1.self_attn.v_proj"] == 32 / 4
    assert adapter.scales["model.layers.0.self_attn.v_proj"] == 8 / 4
    ids = torch.randint(0, 256, (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    with attach_lora(model).batch(LoraBatch([(0, SEQ_LEN, adapter.materialize())])):
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, merged_model(base, path)(input_ids=ids).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_bf16_model_computes_in_its_dtype(tmp_path):
    base = build_model("tiny-llama", dtype=torch.bfloat16)
    path = save_adapter(base, tmp_path / "bf16", seed=5)
    model = copy.deepcopy(base)
    weights = LoraAdapter.load(path, model).materialize()
    assert {lora.a.dtype for lora in weights.modules.values()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    with attach_lora(model).batch(LoraBatch([(0, SEQ_LEN, weights)])):
        logits = model(input_ids=ids).logits
    expected = merged_model(base, path)(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected.float(), atol=0.15, rtol=0.05)


@pytest.mark.gpu
@torch.no_grad()
def test_mixed_batch_on_cuda_matches_cpu(tmp_path):
    base = build_model("tiny-llama")
    path = save_adapter(base, tmp_path / "cuda", seed=6, target_modules=ATTENTION + MLP)
    ids = torch.randint(0, 256, (3, SEQ_LEN), generator=torch.Generator().manual_seed(4))
    logits = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(base).to(device)
        weights = LoraAdapter.load(path, model).materialize(device)
        segments = [(0, SEQ_LEN, weights), (2 * SEQ_LEN, 3 * SEQ_LEN, weights)]   # index path
        with attach_lora(model).batch(LoraBatch(segments)):
            logits[device] = model(input_ids=ids.to(device)).logits.cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=1e-3, rtol=1e-3)
