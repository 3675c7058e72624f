"""An adapter's files are read as PEFT reads them or refused by name: a ``rank_pattern`` /
``alpha_pattern`` key matches a module's name ending at a dot boundary, the first matching key
in file order wins; an alpha that is not a finite number, or a LoRA weight that is not a
floating-point matrix, is refused naming the field or tensor."""
from __future__ import annotations

import json

import pytest
import torch
from peft.utils.other import get_pattern_key
from safetensors.torch import save_file

from vmemkv.runtime.lora import LoraAdapter, LoraConfigError, LoraWeightsError
from vmemkv.runtime.lora.config import read_config
from vmemkv.runtime.models import build_model

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
           "model.layers.11.self_attn.q_proj", "model.layers.1.self_attn.v_proj")


def write_config(directory, **fields) -> str:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def test_the_first_pattern_key_in_file_order_that_matches_wins_as_in_peft(tmp_path):
    ranks = {"q_proj": 8, "layers.0.self_attn.q_proj": 2}          # both match layer 0's q_proj
    alphas = {"v_proj": 32, "1.self_attn.v_proj": 64}
    config = read_config(write_config(tmp_path, rank_pattern=ranks, alpha_pattern=alphas))
    assert [config.rank_of(m) for m in MODULES] == [8, 8, 8, 4]
    assert config.alpha_of("model.layers.1.self_attn.v_proj") == 32
    for module in MODULES:
        assert config.rank_of(module) == ranks.get(get_pattern_key(list(ranks), module), 4)


def test_a_pattern_key_matches_only_a_whole_dotted_suffix_of_the_module_name(tmp_path):
    ranks = {"1.self_attn.q_proj": 2}            # layer 1, not layer 11
    alphas = {"proj": 99}                        # no module's name has a part "proj"
    config = read_config(write_config(tmp_path, rank_pattern=ranks, alpha_pattern=alphas))
    assert [config.rank_of(m) for m in MODULES] == [4, 2, 4, 4]
    assert [config.alpha_of(m) for m in MODULES] == [8] * 4
    assert config.scale_of("model.layers.11.self_attn.q_proj") == 8 / 4
    for module in MODULES:
        assert config.rank_of(module) == ranks.get(get_pattern_key(list(ranks), module), 4)
        assert config.alpha_of(module) == alphas.get(get_pattern_key(list(alphas), module), 8)


@pytest.mark.parametrize("field, value", [
    ("lora_alpha", float("nan")), ("lora_alpha", float("inf")), ("lora_alpha", -float("inf")),
    ("alpha_pattern", {"q_proj": float("nan")}), ("alpha_pattern", {"q_proj": float("inf")}),
])
def test_an_alpha_that_is_not_a_finite_number_is_refused_by_name(tmp_path, field, value):
    path = write_config(tmp_path, **{field: value})       # json writes NaN / Infinity
    with pytest.raises(LoraConfigError, match=f"{field}=") as info:
        read_config(path)
    assert path in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_a_lora_weight_that_is_not_floating_point_is_refused_naming_it(tmp_path, dtype):
    model = build_model("tiny-llama")
    q = "model.layers.0.self_attn.q_proj"
    key = f"base_model.model.{q}.lora_A.weight"
    save_file({key: torch.ones(4, 64, dtype=dtype),
               f"base_model.model.{q}.lora_B.weight": torch.ones(64, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    path = write_config(tmp_path, target_modules=["q_proj"])
    with pytest.raises(LoraWeightsError, match="floating-point") as info:
        LoraAdapter.load(path, model)
    assert key in str(info.value) and path in str(info.value)
