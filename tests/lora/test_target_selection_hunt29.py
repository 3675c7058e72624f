"""PEFT applies an adapter's weights only to the modules its config selects (``target_modules``
less ``exclude_modules``, or its model-type default when ``target_modules`` is not set) and
leaves the file's other weights unused. On main every weight in the file was applied: a config
narrowed to ``["q_proj"]`` over a q/k/v/o file gave logits 5.8 away from PEFT's merged model,
an ``exclude_modules: ["k_proj"]`` 2.4, no ``target_modules`` 4.2 (PEFT's Llama default is
q_proj, v_proj), all silently. Such an adapter is now refused naming the field."""
from __future__ import annotations

import json
import shutil

import pytest

from vmemkv.runtime.lora import LoraAdapter, LoraConfigError
from vmemkv.runtime.models import build_model

from .adapters import save_adapter


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


@pytest.fixture(scope="module")
def original(model, tmp_path_factory):
    return save_adapter(model, tmp_path_factory.mktemp("selection") / "qv", seed=4, r=2,
                        target_modules=("q_proj", "v_proj"))


def with_config(original, tmp_path, **fields) -> str:
    path = shutil.copytree(original, tmp_path / "adapter")
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    for name, value in fields.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    file.write_text(json.dumps(config))
    return str(path)


def refused(model, path, *words) -> None:
    with pytest.raises(LoraConfigError) as info:
        LoraAdapter.load(path, model)
    message = str(info.value)
    assert path in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("targets", [["q_proj"], r".*\.q_proj", ["layers.0.self_attn.v_proj",
                                                                 "q_proj"]])
def test_weights_of_modules_target_modules_does_not_select_are_refused(model, original, tmp_path,
                                                                        targets):
    path = with_config(original, tmp_path, target_modules=targets)
    refused(model, path, "target_modules=", "model.layers.1.self_attn.v_proj", "PEFT leaves them")


def test_weights_of_an_excluded_module_are_refused_naming_exclude_modules(model, original,
                                                                           tmp_path):
    path = with_config(original, tmp_path, exclude_modules=["v_proj"])
    refused(model, path, "2 module(s)", "model.layers.0.self_attn.v_proj",
            "exclude_modules=('v_proj',)")


def test_an_adapter_without_target_modules_is_refused_naming_the_field(model, original,
                                                                        tmp_path):
    path = with_config(original, tmp_path, target_modules=None)
    refused(model, path, "target_modules is not set", "default modules")


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules"])
@pytest.mark.parametrize("value,why", [(3, "a regular expression or a list"),
                                       (["q_proj", 7], "a regular expression or a list"),
                                       ("q_proj(", "not a regular expression")])
def test_a_selection_field_of_the_wrong_form_is_refused_naming_it(model, original, tmp_path,
                                                                   field, value, why):
    path = with_config(original, tmp_path, **{field: value})
    refused(model, path, f"{field}={value!r}", why)
