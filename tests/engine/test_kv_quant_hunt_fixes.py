"""8-bit KV cache rules a hunt found untrue or unchecked: first-write scales are the first
prefill CHUNK's (docs/usage.md), an adapter on K/V is refused on an 8-bit cache, and a
checkpoint's asymmetric or dynamic KV scheme is refused by name."""
from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import DynamicCache

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.adapters import EngineAdapters
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_dtype import kv_encoding
from vmemkv.runtime.lora import LoraTargetError
from vmemkv.runtime.models import build_model

from ..lora.adapters import save_adapter
from ..serve import local_http
from .conftest import reference_model
from .test_engine_kv_checkpoint_scales import OPTIONS, checkpoint_model, with_scales

CHUNK_TOKENS = 16


class _KeyAmax(DynamicCache):
    """transformers' cache, recording per layer the per-KV-head amax of the K it is given."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.k_amax = {}

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.k_amax[layer_idx] = k.abs().float().amax(dim=(0, 2, 3))   # k: [B, H, T, D]
        return super().update(k, v, layer_idx, *args, **kwargs)


def _k_amax(tokens: list) -> torch.Tensor:
    """Per layer, per KV head amax of the K tiny-llama writes for ``tokens`` [layers, heads]."""
    m = reference_model("tiny-llama")
    cache = _KeyAmax(m.config)
    with torch.inference_mode():
        m(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return torch.stack([cache.k_amax[i] for i in range(m.config.num_hidden_layers)])


def _small_k_first() -> list:
    """40 token ids: the 24 with the smallest layer-0 K first, the 16 with the largest last."""
    m = reference_model("tiny-llama")
    layer = m.model.layers[0]
    with torch.no_grad():
        k = layer.self_attn.k_proj(layer.input_layernorm(m.model.embed_tokens.weight))
    order = k.abs().amax(-1).argsort().tolist()
    return order[:24] + order[-16:]


def test_first_write_scales_are_the_first_prefill_chunks_amax_over_the_encodings_max():
    prompt = _small_k_first()
    int8 = kv_encoding("int8", torch.float32)
    with Engine(build_model("tiny-llama", seed=0), max_batch=1, max_context=64,
                self_check=False, kv_cache_dtype="int8",
                max_tokens_per_step=CHUNK_TOKENS) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
        scales = engine.kv.cache.kv_scales.k
    # layer 0 only: later layers' K read the earlier layers' 8-bit K/V, the reference's do not
    chunk = _k_amax(prompt[:CHUNK_TOKENS])[0] / int8.max_value
    whole = _k_amax(prompt)[0] / int8.max_value
    assert torch.allclose(scales[0], chunk, rtol=1e-5, atol=0)   # the documented rule
    assert bool((whole > 1.5 * scales[0]).all())     # not the whole prompt's: the rest clips


def test_the_kv_scales_help_says_first_write_is_the_first_prefill_chunk(capsys):
    from vmemkv.cli import main
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")   # wrapped at -
    assert "first write: the first prefill chunk, at most 2048 tokens or --max-batch" in help_text


@pytest.fixture(scope="module")
def int8_manager():
    """An int8 cache's manager (EngineAdapters reserves adapter pages through it), large enough
    that the q/o/MLP adapter leaves KV room beside it (add_lora refuses one that leaves none)."""
    with Engine(build_model("tiny-llama", seed=0), kv_cache_dtype="int8",
                **{**OPTIONS, "cache_bytes": 64 * 1024}) as engine:
        yield engine.kv.manager


@pytest.mark.parametrize("targets, kv_cache_dtype, refused", [
    (("k_proj", "v_proj"), "int8", "k_proj, v_proj"),
    (("v_proj",), "fp8_e4m3", "v_proj"),
    (("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "int8", None),
    (("k_proj", "v_proj"), "auto", None),
    (("k_proj", "v_proj"), "bf16", None),
], ids=["kv-int8", "v-fp8", "q-o-mlp-int8", "kv-auto", "kv-bf16"])
def test_an_adapter_on_kv_is_refused_on_an_8bit_cache_and_others_load(
        tmp_path, int8_manager, targets, kv_cache_dtype, refused):
    model = build_model("tiny-llama", seed=0)
    path = save_adapter(model, tmp_path / "adapter", seed=3, target_modules=targets)
    adapters = EngineAdapters(model, int8_manager, lambda: (), kv_cache_dtype=kv_cache_dtype)
    if refused is None:
        assert adapters.add("wide", path).name == "wide"
        assert adapters.names == ["wide"]
        return
    with pytest.raises(LoraTargetError, match=rf"adapter 'wide' .* targets {refused} "
                       rf"\(\d+ modules: model\.layers\.0\.self_attn\.{refused[:6]}.*"
                       rf"kv_cache_dtype is '{kv_cache_dtype}'"):
        adapters.add("wide", path)
    assert adapters.names == [] and not adapters       # nothing registered, no host copy held


def test_engine_add_lora_refuses_a_kv_adapter_on_an_8bit_cache_and_changes_nothing(tmp_path):
    model = build_model("tiny-llama", seed=0)
    kv_path = save_adapter(model, tmp_path / "kv", seed=3, target_modules=("k_proj", "v_proj"))
    q_path = save_adapter(model, tmp_path / "q", seed=3, target_modules=("q_proj", "down_proj"))
    with Engine(model, kv_cache_dtype="int8", **OPTIONS) as engine:
        with pytest.raises(LoraTargetError, match=r"adapter 'kv' .* targets k_proj, v_proj .*"
                                                  r"kv_cache_dtype is 'int8'"):
            engine.add_lora("kv", kv_path)
        assert engine.loras == []
        engine.add_lora("q", q_path)
        assert engine.loras == ["q"]


def test_the_servers_load_route_answers_400_naming_lora_path_for_a_kv_adapter(tmp_path):
    from vmemkv.runtime.serve import Server
    model = build_model("tiny-llama", seed=0)
    save_adapter(model, tmp_path / "kv", seed=3, target_modules=("v_proj",))
    with Engine(model, kv_cache_dtype="fp8_e4m3", **OPTIONS) as engine, \
            Server(engine, "tiny-llama", host="127.0.0.1", port=0,
                   lora_root=tmp_path).start() as server:
        response = local_http.post(server.url + "/v1/load_lora_adapter", timeout=60,
                                   content=json.dumps({"lora_name": "kv", "lora_path": "kv"}),
                                   headers={"Content-Type": "application/json"})
        assert engine.loras == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path"
    assert re.search(r"adapter 'kv' .* targets v_proj .*kv_cache_dtype is 'fp8_e4m3'",
                     error["message"])


@pytest.mark.parametrize("field, value", [
    ("symmetric", False), ("dynamic", True), ("dynamic", "local"),
], ids=["asymmetric", "dynamic", "dynamic-local"])
def test_an_asymmetric_or_dynamic_kv_cache_scheme_is_refused_naming_the_field(field, value):
    m = checkpoint_model()
    m.config.quantization_config = {"kv_cache_scheme": {
        "type": "int", "num_bits": 8, "strategy": "tensor", field: value}}
    with pytest.raises(CacheConfigError, match=rf"kv_cache_scheme\.{field} is {value!r}"):
        Engine(m, kv_cache_dtype="int8", **OPTIONS)
    m.config.quantization_config["kv_cache_scheme"].update(symmetric=True, dynamic=False)
    with Engine(m, kv_cache_dtype="int8", **OPTIONS) as engine:      # spelled out: accepted
        assert engine.kv_scales_source == "checkpoint"


@pytest.mark.parametrize("attribute", ["k_zero_point", "v_zero_point", "kv_zero_point"])
def test_a_kv_zero_point_on_an_attention_module_is_refused_naming_it(attribute):
    m = with_scales(l0={"kv_scale": 0.05, attribute: [3.0]}, l1={"kv_scale": 0.05})
    with pytest.raises(CacheConfigError,
                       match=rf"model\.layers\.0\.self_attn\.{attribute}: .* zero points"):
        Engine(m, kv_cache_dtype="int8", **OPTIONS)
