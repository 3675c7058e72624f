"""Every adapter we would compute differently from PEFT is refused by a typed user error (a
ValueError) whose message names the adapter's path and the field, tensor or module at fault."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vmemkv.runtime.errors import RuntimeKVError
from vmemkv.runtime import memory
from vmemkv.runtime.lora import (LoraAdapter, LoraConfigError, LoraError, LoraMemoryError,
                                 LoraTargetError, LoraWeightsError)
from vmemkv.runtime.models import build_model

from .adapters import save_adapter

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


@pytest.fixture(scope="module")
def original(model, tmp_path_factory):
    return save_adapter(model, tmp_path_factory.mktemp("refusals") / "ok", seed=1, r=4,
                        target_modules=("q_proj", "down_proj"))


@pytest.fixture
def adapter_dir(original, tmp_path):
    """A fresh copy of a valid adapter, to spoil."""
    return shutil.copytree(original, tmp_path / "adapter")


def edit_config(path, **fields):
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(fields)
    file.write_text(json.dumps(config))


def edit_weights(path, edit):
    file = str(path / "adapter_model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def refused(error_type, model, path, *words):
    with pytest.raises(error_type) as info:
        LoraAdapter.load(path, model)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, (word, message)


def test_the_valid_adapter_loads(model, adapter_dir):
    assert len(LoraAdapter.load(adapter_dir, model).modules) == 4


@pytest.mark.parametrize("field, value", [
    ("peft_type", "IA3"), ("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all"),
    ("bias", "lora_only"), ("fan_in_fan_out", True), ("layers_to_transform", [0]),
    ("layer_replication", [[0, 1]]), ("lora_bias", True), ("trainable_token_indices", [1, 2]),
    ("target_parameters", ["mlp.experts.weight"]), ("alora_invocation_tokens", [5, 6]),
    ("use_qalora", True), ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}),
    ("kasa_config", {"r": 1}), ("monteclora_config", {"n": 2}), ("arrow_config", {"top_k": 2}),
    ("r", 0), ("r", "4"), ("lora_alpha", None), ("use_rslora", "yes"),
    ("rank_pattern", {"q_proj": -1}), ("alpha_pattern", ["q_proj"]),
])
def test_config_fields_we_do_not_run_are_refused_by_name(model, adapter_dir, field, value):
    edit_config(adapter_dir, **{field: value})
    refused(LoraConfigError, model, adapter_dir, f"{field}=")


def test_a_directory_without_config_or_a_missing_directory_is_refused(model, adapter_dir, tmp_path):
    (adapter_dir / "adapter_config.json").unlink()
    refused(LoraConfigError, model, adapter_dir, "adapter_config.json")
    refused(LoraConfigError, model, tmp_path / "nowhere", "not a directory")
    (adapter_dir / "adapter_config.json").write_text("{not json")
    refused(LoraConfigError, model, adapter_dir, "adapter_config.json")


def test_a_missing_weight_file_and_a_pickle_are_refused(model, adapter_dir):
    weights = adapter_dir / "adapter_model.safetensors"
    weights.unlink()
    refused(LoraWeightsError, model, adapter_dir, "adapter_model.safetensors")
    (adapter_dir / "adapter_model.bin").write_bytes(b"pickle")
    refused(LoraWeightsError, model, adapter_dir, "adapter_model.bin", "refused")
    weights.write_bytes(b"not safetensors")
    refused(LoraWeightsError, model, adapter_dir, "adapter_model.safetensors")


def test_a_module_missing_its_a_or_b_is_refused(model, adapter_dir):
    edit_weights(adapter_dir, lambda t: t.pop(f"base_model.model.{Q}.lora_B.weight"))
    refused(LoraWeightsError, model, adapter_dir, Q, "lora_B")


@pytest.mark.parametrize("key", [f"base_model.model.{Q}.lora_B.bias",
                                 f"base_model.model.{Q}.lora_magnitude_vector",
                                 "base_model.model.model.norm.weight"])
def test_tensors_that_are_not_lora_weights_are_refused(model, adapter_dir, key):
    edit_weights(adapter_dir, lambda t: t.update({key: torch.zeros(64)}))
    refused(LoraWeightsError, model, adapter_dir, key)


def _add_pair(module, a_shape, b_shape, embedding=False):
    suffix = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight",
                                                                          "lora_B.weight")

    def edit(tensors):
        tensors[f"base_model.model.{module}.{suffix[0]}"] = torch.zeros(a_shape)
        tensors[f"base_model.model.{module}.{suffix[1]}"] = torch.zeros(b_shape)
    return edit


@pytest.mark.parametrize("module, a_shape, b_shape, embedding, words", [
    ("model.embed_tokens", (4, 256), (64, 4), True, ["embed_tokens", "embedding"]),
    ("model.embed_tokens", (4, 256), (64, 4), False, ["embed_tokens", "embeddings"]),
    ("lm_head", (4, 64), (256, 4), False, ["lm_head", "output head"]),
    ("model.layers.0.input_layernorm", (4, 64), (64, 4), False, ["input_layernorm", "LlamaRMSNorm"]),
    ("model.layers.0.mlp.act_fn", (4, 64), (64, 4), False, ["act_fn"]),
    ("model.layers.7.self_attn.q_proj", (4, 64), (64, 4), False, ["layers.7", "does not have"]),
])
def test_targets_outside_the_decoder_projections_are_refused(model, adapter_dir, module, a_shape,
                                                             b_shape, embedding, words):
    edit_weights(adapter_dir, _add_pair(module, a_shape, b_shape, embedding))
    refused(LoraTargetError, model, adapter_dir, "target_modules", *words)


@pytest.mark.parametrize("part, shape, expected", [("lora_A", (4, 65), (4, 64)),
                                                   ("lora_B", (63, 4), (64, 4))])
def test_a_shape_the_model_does_not_have_is_refused_naming_module_and_shapes(model, adapter_dir,
                                                                             part, shape, expected):
    key = f"base_model.model.{Q}.{part}.weight"
    edit_weights(adapter_dir, lambda t: t.update({key: torch.zeros(shape)}))
    refused(LoraTargetError, model, adapter_dir, f"{Q}.{part}", str(shape), str(expected))


def test_a_rank_other_than_the_config_says_is_refused(model, adapter_dir):
    edit_config(adapter_dir, rank_pattern={"q_proj": 8})
    refused(LoraWeightsError, model, adapter_dir, Q, "rank_pattern", "r=8", "rank 4")


def test_a_and_b_of_different_ranks_are_refused(model, adapter_dir):
    key = f"base_model.model.{Q}.lora_B.weight"
    edit_weights(adapter_dir, lambda t: t.update({key: torch.zeros(64, 3)}))
    refused(LoraWeightsError, model, adapter_dir, Q, "rank 4", "rank 3")


def test_refusals_are_user_errors_of_the_runtime():
    # the CLI and the server report a ValueError as the user's, in one line
    for error in (LoraConfigError, LoraWeightsError, LoraTargetError, LoraMemoryError):
        assert issubclass(error, LoraError) and issubclass(error, ValueError)
        assert issubclass(error, RuntimeKVError)
    assert issubclass(LoraMemoryError, MemoryError)


def _load_bytes(model, path) -> int:
    """One host copy's bytes: the file's tensors as read, and every weight in the model's dtype."""
    numel = sum(t.numel() for t in load_file(path / "adapter_model.safetensors").values())
    return (path / "adapter_model.safetensors").stat().st_size + numel * 4   # fp32 model


def test_an_adapter_larger_than_the_hosts_available_memory_is_refused_before_reading(
        model, adapter_dir, monkeypatch):
    need = _load_bytes(model, adapter_dir)
    read = []
    monkeypatch.setattr("vmemkv.runtime.lora.adapter._read_tensors", lambda p: read.append(p))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: need - 1)
    with pytest.raises(LoraMemoryError, match=f"needs {need} bytes of host memory .* more than "
                                              f"the {need - 1} bytes available"):
        LoraAdapter.load(adapter_dir, model)
    # one copy per process that holds it: two tensor-parallel ranks need twice the bytes
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * need - 1)
    with pytest.raises(LoraMemoryError, match=f"needs {2 * need} bytes .* x 2 processes"):
        LoraAdapter.load(adapter_dir, model, host_copies=2)
    assert read == []                                       # refused before reading the weights
    # what a grown KV pool promised and has not created is not available to the adapter
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: need + 100)
    monkeypatch.setattr(memory, "promised_bytes", lambda device, excluding=None: 101)
    with pytest.raises(LoraMemoryError, match=f"more than the {need - 1} bytes available"):
        LoraAdapter.load(adapter_dir, model)
    monkeypatch.undo()
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: need)
    assert LoraAdapter.load(adapter_dir, model).num_bytes > 0    # exactly fits


def test_engine_add_lora_short_of_host_memory_changes_nothing(model, adapter_dir, monkeypatch):
    from vmemkv.runtime.engine import Engine, SamplingParams
    with Engine(build_model("tiny-llama"), max_batch=2, max_context=64) as engine:
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1000)
        with pytest.raises(LoraMemoryError, match="1000 bytes available"):
            engine.add_lora("a", adapter_dir)
        assert engine.adapters.names == [] and not engine.adapters
        monkeypatch.undo()
        engine.add_lora("a", adapter_dir)
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, lora="a"))
        assert out[0].status == "finished"
