"""Adapter configs PEFT writes that we would run differently from the model they were trained
for are refused by the option at fault, before a weight is read: an ``init_lora_weights`` that
trained the adapter on a changed copy of the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA;
their converted form matches PEFT), a ``rank_pattern`` / ``alpha_pattern`` key that is not a
regular expression, ``velora_config``; an embedding or ``lm_head`` target, as PEFT saves it (its
``base_layer`` copy first), by ``target_modules``."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import peft
import pytest
import torch
from safetensors import safe_open

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.lora import (LoraAdapter, LoraBatch, LoraConfigError, LoraTargetError,
                                 attach_lora)
from vmemkv.runtime.lora.config import read_config
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server

from ..serve import local_http
from .adapters import save_adapter
from .test_refusals import adapter_dir, edit_config, original, refused  # noqa: F401 (fixtures)

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 40, 7]])
CONVERSION = "path_initial_model_for_weight_conversion"


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama").eval()




def trained(model, directory, init: str):
    """An adapter initialised with ``init`` and "trained" (A and B moved), saved twice: as PEFT
    saves it by default, and converted to a LoRA of the original weights."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=init)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        peft_model = peft.get_peft_model(copy.deepcopy(model), config)
        peft_model.peft_config["default"].init_lora_weights = True   # PEFT's documented recipe
        peft_model.save_pretrained(str(directory / "initial"))
        peft_model.peft_config["default"].init_lora_weights = init
        with torch.no_grad():
            for name, weight in peft_model.named_parameters():
                if "lora_" in name:
                    weight.add_(0.3 * torch.randn(weight.shape))
    peft_model.save_pretrained(str(directory / "as-saved"))
    peft_model.save_pretrained(str(directory / "converted"), **{
        CONVERSION: str(directory / "initial")})
    return str(directory / "as-saved"), str(directory / "converted")


@torch.no_grad()
def served_logits(model, path):
    """Logits of ``IDS`` through our LoRA forward with the adapter at ``path``."""
    served = copy.deepcopy(model)
    adapter = LoraAdapter.load(path, served)
    with attach_lora(served).batch(LoraBatch([(0, IDS.shape[1], adapter.materialize())])):
        return served(input_ids=IDS).logits


@torch.no_grad()
def peft_logits(model, path):
    return peft.PeftModel.from_pretrained(copy.deepcopy(model), path).eval()(input_ids=IDS).logits


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_trained_on_changed_base_weights_is_refused_its_converted_form_matches_peft(
        model, tmp_path, monkeypatch, init):
    as_saved, converted = trained(model, tmp_path, init)
    read = []
    monkeypatch.setattr("vmemkv.runtime.lora.adapter._read_tensors", lambda p: read.append(p))
    refused(LoraConfigError, model, as_saved, f"init_lora_weights={init!r}", CONVERSION)
    assert read == []                                       # refused before reading the weights
    monkeypatch.undo()
    assert json.loads((tmp_path / "converted" / "adapter_config.json").read_text())[
        "init_lora_weights"] is True
    ours = served_logits(model, converted)
    # the model as trained: PEFT rebuilds the changed base weights for the as-saved form
    for reference in (peft_logits(model, converted), peft_logits(model, as_saved)):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert (ours - model(input_ids=IDS).logits).abs().max() > 0.1, "the adapter changes logits"


# PEFT's LoraLayer.update_layer: pissa* / corda* by prefix, olora in any case, loftq and lora_ga
# (LoRA-GA trains on W - scale * B0 @ A0, yet PEFT's own reload adds B @ A to W: wrong there too)
CHANGED_BASE = ["pissa", "pissa_niter_4", "corda", "olora", "OLoRA", "loftq", "lora_ga"]
UNKNOWN = ["kaiming", 3, ["pissa"]]
KEEPS_BASE = [True, False, None, "gaussian", "eva", "orthogonal", "mica"]


def test_init_lora_weights_is_refused_by_name_exactly_when_it_changed_the_base_weights(
        model, adapter_dir):
    for value in CHANGED_BASE + UNKNOWN:
        edit_config(adapter_dir, init_lora_weights=value)
        hint = CONVERSION if value in CHANGED_BASE and value != "loftq" else "init_lora_weights"
        refused(LoraConfigError, model, adapter_dir, f"init_lora_weights={value!r}", hint)
    for value in KEEPS_BASE:
        edit_config(adapter_dir, init_lora_weights=value)
        assert len(LoraAdapter.load(adapter_dir, model).modules) == 4, value


@pytest.mark.parametrize("field, bad", [("rank_pattern", "q_proj("), ("alpha_pattern", "[q]_proj["),
                                        ("alpha_pattern", "*q_proj")])
def test_a_pattern_key_that_is_not_a_regex_is_refused_naming_the_field(model, adapter_dir, field,
                                                                      bad):
    edit_config(adapter_dir, **{field: {"down_proj": 4, bad: 4}})
    refused(LoraConfigError, model, adapter_dir, f"{field}=", repr(bad), "regular expression")
    with pytest.raises(LoraConfigError, match=field):      # serve --lora's check before starting
        read_config(str(adapter_dir))
    # the keys PEFT accepts still pick their modules: a regex alternative, a suffix
    edit_config(adapter_dir, rank_pattern={}, alpha_pattern={r"layers\.0\.self_attn\.(q|k)_proj": 2,
                                                             "down_proj": 32})
    scales = LoraAdapter.load(adapter_dir, model).scales
    assert scales["model.layers.0.self_attn.q_proj"] == 2 / 4
    assert scales["model.layers.1.self_attn.q_proj"] == 8 / 4
    assert scales["model.layers.1.mlp.down_proj"] == 32 / 4


@pytest.mark.parametrize("targets, words", [
    (("q_proj", "embed_tokens"), ["model.embed_tokens", "embeddings"]),
    (("q_proj", "lm_head"), ["'lm_head'", "output head"]),
])
def test_embedding_and_lm_head_targets_as_peft_saves_them_are_refused_by_target_modules(
        model, tmp_path, targets, words):
    path = save_adapter(model, tmp_path / "adapter", seed=2, target_modules=targets)
    with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as weights:
        assert any(key.endswith("base_layer.weight") for key in weights.keys())   # met first
    refused(LoraTargetError, model, path, "target_modules", *words)


def test_velora_is_refused_by_its_config_field(model, tmp_path):
    from peft.tuners.lora.config import VeloraConfig
    path = save_adapter(model, tmp_path / "adapter", seed=3, velora_config=VeloraConfig())
    refused(LoraConfigError, model, path, "velora_config=")


@contextlib.contextmanager
def serving(model, root):
    with Engine(copy.deepcopy(model), cache="vmem", page_bytes=4096, max_batch=4,
                max_context=64) as engine:
        with Server(engine, "tiny-llama", host="127.0.0.1", port=0,
                    lora_root=str(root)).start() as server:
            yield server, engine


def test_over_http_both_refusals_are_a_400_naming_lora_path_and_change_nothing(model, original,
                                                                               tmp_path):
    for name, fields in (("pissa", {"init_lora_weights": "pissa"}),
                         ("regex", {"alpha_pattern": {"q_proj(": 16}}), ("ok", {})):
        edit_config(shutil.copytree(original, tmp_path / name), **fields)
    with serving(model, tmp_path) as (server, engine):
        for name, field in (("pissa", "init_lora_weights"), ("regex", "alpha_pattern")):
            answer = local_http.post(server.url + "/v1/load_lora_adapter", timeout=60,
                                     json={"lora_name": name, "lora_path": name})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "lora_path"
            assert field in answer.json()["error"]["message"]
        assert engine.loras == []
        ok = local_http.post(server.url + "/v1/load_lora_adapter", timeout=60,
                             json={"lora_name": "ok", "lora_path": "ok"})
        assert ok.status_code == 200, ok.text      # the server still loads a good one
        assert engine.loras == ["ok"]
