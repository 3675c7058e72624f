"""Hunt 31, LoRA adapters: configs PEFT reads one way and we read another, and adapter files that
escaped as raw Python errors instead of a LoraError naming the file and field."""
from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

from vmemkv.runtime.lora import LoraAdapter, LoraConfigError  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

Q_PROJ = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


@functools.lru_cache(maxsize=None)
def model():
    return build_model("tiny-llama", seed=0)


def write_adapter(folder, config_text: str = None, **fields) -> str:
    """A rank-2 adapter on both layers' q_proj of tiny-llama (64 wide), config fields as given."""
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **fields}
    (folder / "adapter_config.json").write_text(config_text or json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    tensors = {Q_PROJ.format(layer, part): torch.randn(shape, generator=generator)
               for layer in (0, 1) for part, shape in (("A", (2, 64)), ("B", (64, 2)))}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("value", [0, False, [0], 1])
def test_layers_to_transform_that_picks_a_layer_is_refused_as_an_int_too(tmp_path, value):
    """PEFT reads an int (0, and false, too) as "only this layer" and leaves the file's other
    layers unused; 0 and false were taken as unset and every layer's weights were applied."""
    path = write_adapter(tmp_path / "a", layers_to_transform=value)
    with pytest.raises(LoraConfigError, match=r"layers_to_transform=.* is not supported"):
        LoraAdapter.load(path, model())


@pytest.mark.parametrize("value", [None, []])
def test_layers_to_transform_unset_or_empty_loads_every_layer(tmp_path, value):
    adapter = LoraAdapter.load(write_adapter(tmp_path / "a", layers_to_transform=value), model())
    assert adapter.modules == ("model.layers.0.self_attn.q_proj",
                               "model.layers.1.self_attn.q_proj")


def test_a_config_nested_past_pythons_stack_is_a_config_error_naming_the_file(tmp_path):
    """json.load raised RecursionError through LoraAdapter.load (a 500 from
    /v1/load_lora_adapter, a traceback from `vmemkv serve --lora`)."""
    path = write_adapter(tmp_path / "a", config_text="[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoraConfigError, match=r"cannot read adapter_config\.json"):
        LoraAdapter.load(path, model())


@pytest.mark.parametrize("field, text", [("lora_alpha", "1" + "0" * 400),
                                         ("alpha_pattern", '{"q_proj": 1' + "0" * 400 + "}")])
def test_an_alpha_past_a_floats_range_written_as_an_int_is_refused_by_name(tmp_path, field, text):
    """JSON keeps an integer's digits: 10**400 reached math.isfinite, whose OverflowError
    escaped LoraAdapter.load (a 500 from /v1/load_lora_adapter)."""
    config = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                         "target_modules": ["q_proj"], field: "@"}).replace('"@"', text)
    path = write_adapter(tmp_path / "a", config_text=config)
    with pytest.raises(LoraConfigError, match=rf"{field}=.* is not supported"):
        LoraAdapter.load(path, model())


def test_an_adapter_that_leaves_no_token_of_kv_beside_it_is_refused_when_added(tmp_path):
    """Its pages fit the pool (2 of 4) but leave no page group for a sequence: it loaded, and
    every request on it was refused ("the cache holds 0 tokens of one sequence beside it"),
    over HTTP a 404 for a model /v1/models listed with max_model_len 64."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.engine.errors import EngineConfigError
    path = write_adapter(tmp_path / "a")
    small = dict(max_batch=2, max_context=64, cache="vmem", page_bytes=4096)
    with Engine(build_model("tiny-llama", seed=0), cache_bytes=16 * 1024, **small) as engine:
        with pytest.raises(EngineConfigError, match=r"adapter 'a' needs \d+ bytes \(1 pool "
                           r"pages\), which leave no room for one token of KV beside it"):
            engine.add_lora("a", path)
        assert engine.loras == []
        assert engine.adapters.gauges()["lora_adapters_loaded"] == 0
    with Engine(build_model("tiny-llama", seed=0), cache_bytes=32 * 1024, **small) as engine:
        engine.add_lora("a", path)        # a page group beside it: 16 tokens of one sequence
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, lora="a"))[0]
        assert out.status == "finished" and len(out.outputs[0].token_ids) == 4


def test_vllms_load_inplace_and_lora_int_id_fields_are_taken_as_vllm_takes_them(tmp_path):
    """The routes say they take vLLM's bodies; vLLM's ``load_inplace`` (replace a loaded name)
    and its optional ``lora_int_id`` on unload were 400s naming them as unknown fields."""
    import httpx

    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.serve import Server
    write_adapter(tmp_path / "one")
    write_adapter(tmp_path / "two")
    (tmp_path / "two" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    with Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64, cache="vmem",
                page_bytes=4096, cache_bytes=64 * 1024) as engine:
        with Server(engine, "tiny", host="127.0.0.1", port=0, lora_root=tmp_path).start() as server:
            def post(path: str, body: dict) -> httpx.Response:
                return httpx.post(server.url + path, json=body, timeout=60, verify=False)

            assert post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "one"}
                        ).status_code == 200
            digest = engine.adapters.ref("a").digest
            taken = post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "two"})
            assert taken.status_code == 409 and engine.adapters.ref("a").digest == digest
            inplace = post("/v1/load_lora_adapter",
                           {"lora_name": "a", "lora_path": "two", "load_inplace": True})
            assert inplace.status_code == 200, inplace.text
            assert engine.adapters.ref("a").digest != digest     # alpha 8: the other adapter
            gone = post("/v1/unload_lora_adapter", {"lora_name": "a", "lora_int_id": 1})
            assert gone.status_code == 200, gone.text
            assert engine.loras == []


def test_a_request_naming_no_loaded_adapter_is_an_unknown_adapter_error():
    """Its own type (the server's 404 reads it), not any rejection whose field is ``lora``: a
    loaded adapter that leaves a request too little room is a plain RequestRejectedError (a
    400 naming ``model``), which the server had answered 404 "not served"."""
    from vmemkv.runtime.engine import (Engine, RequestRejectedError, SamplingParams,
                                       UnknownAdapterError)
    with Engine(build_model("tiny-llama", seed=0), cache="vmem", max_batch=2,
                max_context=64) as engine:
        with pytest.raises(UnknownAdapterError, match="names no loaded adapter: 'gone'") as error:
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, lora="gone"))
    assert isinstance(error.value, RequestRejectedError) and error.value.field == "lora"
