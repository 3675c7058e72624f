"""``layout="auto"`` on real memory: the engine and VMemCache resolve it at construction (the
config, the manager's layout and the cache all say the resolved one) and compute the tokens
the resolved layout computes; unknown layouts are refused by name before anything is built."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, EngineConfig, EngineConfigError, SamplingParams
from vmemkv.runtime.hf.cache import VMemCache
from vmemkv.runtime.models import build_model

KiB = 2**10


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


@pytest.mark.parametrize("page_bytes, layout", [(None, "interleaved"), (4 * KiB, "per-layer")])
def test_the_engine_resolves_auto_and_computes_what_that_layout_computes(model, page_bytes, layout):
    # tiny-llama: 4 layers, 2 KV heads x 16 dims x fp32 = 128 bytes a layer's K of a token; the
    # host's default 64 KiB page gives per-layer groups of 512 tokens (> 128: interleaved), a
    # 4 KiB page 32 (per-layer)
    prompts = [[5, 7, 11, 13, 17], [3, 1, 4, 1, 5, 9, 2, 6]]
    auto = Engine(model, layout="auto", page_bytes=page_bytes, max_batch=2, max_context=64)
    assert auto.config.layout == layout
    assert auto.kv.manager.layout().geometry.layout.value == layout
    got = [o.outputs[0].token_ids for o in auto.generate(prompts, SamplingParams(max_new_tokens=6))]
    same = Engine(model, layout=layout, page_bytes=page_bytes, max_batch=2, max_context=64)
    assert got == [o.outputs[0].token_ids for o in same.generate(prompts, SamplingParams(max_new_tokens=6))]


def test_vmem_cache_resolves_auto(model):
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=32, layout="auto")
    assert cache.manager.layout().geometry.layout.value == "interleaved"
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=32, layout="auto",
                                        page_bytes=4 * KiB)
    assert cache.manager.layout().geometry.layout.value == "per-layer"


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(EngineConfigError, match="layout"):
        EngineConfig(layout="diagonal")


def test_a_hybrid_model_gets_per_layer_the_only_layout_that_gives_window_pages_back():
    hybrid = build_model("tiny-gemma3")
    cache = VMemCache.from_model_config(hybrid.config, max_batch=1, max_context=32, layout="auto")
    assert cache.manager.layout().geometry.layout.value == "per-layer"
