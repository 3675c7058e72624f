"""The vmemkv attention function: registered with transformers, refuses to run without a step."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.hf.attention import ATTN_IMPLEMENTATION, UnsupportedModelError, register_attention
from vmemkv.runtime.models import build_model


def test_registered_under_its_name():
    from transformers import AttentionInterface
    assert register_attention() == ATTN_IMPLEMENTATION
    assert ATTN_IMPLEMENTATION in AttentionInterface._global_mapping


def test_model_call_without_a_step_context_is_a_typed_error():
    model = build_model("tiny-llama")
    Engine(model, max_batch=2, max_context=64).close()       # switches the model to vmemkv
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with pytest.raises(UnsupportedModelError):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_bad_engine_options_are_typed_errors():
    model = build_model("tiny-llama")
    with pytest.raises(EngineConfigError):
        Engine(model, cache="nope")
    with pytest.raises(EngineConfigError):
        Engine(model, no_such_option=1)
    with pytest.raises(EngineConfigError):
        SamplingParams(top_p=0.0)
