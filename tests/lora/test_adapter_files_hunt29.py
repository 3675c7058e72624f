"""Adapter files that loaded on main and then computed something other than what they say:
a module's weight stored twice (with and without PEFT's ``base_model.model.`` prefix: one
silently won, and the logits were 2.6 away from PEFT's merged model's), NaN or infinite
weights, in the file or once cast to the model's dtype (every request on the adapter failed
at its first step with NonFiniteLogitsError, and a request alone in its step raised out of
``generate`` and stayed in the engine), and a bytes path (a raw TypeError from
``os.path.join``). Each is now refused by name at load."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vmemkv.runtime.lora import LoraAdapter, LoraConfigError, LoraWeightsError
from vmemkv.runtime.models import build_model

from .adapters import save_adapter

PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


@pytest.fixture(scope="module")
def original(model, tmp_path_factory):
    return save_adapter(model, tmp_path_factory.mktemp("files") / "ok", seed=3, r=2,
                        target_modules=("q_proj",))


def spoiled(original, tmp_path, edit) -> str:
    path = shutil.copytree(original, tmp_path / "adapter")
    file = str(path / "adapter_model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return str(path)


def first_key(tensors) -> str:
    return sorted(tensors)[0]


def test_a_weight_stored_with_and_without_the_prefix_is_refused_naming_both_keys(
        model, original, tmp_path):
    def duplicate(tensors):
        key = first_key(tensors)
        tensors[key[len(PREFIX):]] = torch.zeros_like(tensors[key])
    path = spoiled(original, tmp_path, duplicate)
    with pytest.raises(LoraWeightsError, match="twice") as info:
        LoraAdapter.load(path, model)
    message = str(info.value)
    assert path in message
    assert "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'" in message
    assert "'model.layers.0.self_attn.q_proj.lora_A.weight'" in message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_holding_nan_or_inf_is_refused_naming_the_tensor(model, original, tmp_path,
                                                                   value):
    def poison(tensors):
        tensors[first_key(tensors)][0, 1] = value
        tensors[first_key(tensors)][1, 0] = value
    path = spoiled(original, tmp_path, poison)
    with pytest.raises(LoraWeightsError, match="holds 2 NaN or infinite values") as info:
        LoraAdapter.load(path, model)
    assert "model.layers.0.self_attn.q_proj.lora_A" in str(info.value)
    assert path in str(info.value)


def test_a_weight_past_the_models_dtype_range_is_refused_naming_the_dtype(original, tmp_path):
    def huge(tensors):                                   # finite in fp32, inf in fp16
        tensors[sorted(tensors)[1]][3, 0] = 1e5          # layers.0's q_proj.lora_B
    path = spoiled(original, tmp_path, huge)
    fp16 = build_model("tiny-llama", dtype=torch.float16)
    with pytest.raises(LoraWeightsError, match=r"q_proj.lora_B holds 1 NaN or infinite values "
                                               r"\(of 128\) in the model's torch.float16"):
        LoraAdapter.load(path, fp16)


@pytest.mark.parametrize("path", [b"/tmp", 3, None])
def test_a_path_that_is_no_str_is_a_config_error_naming_its_type(model, path):
    with pytest.raises(LoraConfigError, match=f"got {type(path).__name__}"):
        LoraAdapter.load(path, model)
