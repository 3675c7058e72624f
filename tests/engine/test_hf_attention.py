"""The vmemkv attention function: registered with transformers, refuses to run without a step."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.hf.attention import (ATTN_IMPLEMENTATION, UnsupportedModelError, register_attention,
                                         use_vmemkv_attention)
from vmemkv.runtime.models import build_model


def test_registered_under_its_name():
    from transformers import AttentionInterface
    assert register_attention() == ATTN_IMPLEMENTATION
    assert ATTN_IMPLEMENTATION in AttentionInterface._global_mapping


def test_model_call_without_a_step_context_is_a_typed_error():
    model = build_model("tiny-llama")
    use_vmemkv_attention(model)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with pytest.raises(UnsupportedModelError):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_engine_close_restores_the_models_attention_implementation(cache):
    model = build_model("tiny-llama")
    before = model.config._attn_implementation
    ids = torch.tensor([[5, 17, 33, 9]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine = Engine(model, cache=cache, max_batch=2, max_context=64)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION     # ours while open
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    engine.close()
    assert model.config._attn_implementation == before
    with torch.no_grad():                                               # plain calls work again
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_failed_engine_construction_restores_the_models_attention_implementation():
    model = build_model("tiny-llama")
    before = model.config._attn_implementation
    with pytest.raises(EngineConfigError):
        Engine(model, max_batch=2, max_context=64, cache_bytes=1, memory_utilization=0.5)
    from vmemkv.scheduler.errors import ConfigError
    with pytest.raises(ConfigError):
        Engine(model, max_batch=2, max_context=64, page_bytes=3)
    assert model.config._attn_implementation == before


def test_bad_engine_options_are_typed_errors():
    model = build_model("tiny-llama")
    with pytest.raises(EngineConfigError):
        Engine(model, cache="nope")
    with pytest.raises(EngineConfigError):
        Engine(model, no_such_option=1)
    with pytest.raises(EngineConfigError):
        SamplingParams(top_p=0.0)


def test_a_model_refused_by_the_self_check_is_left_on_its_own_attention(monkeypatch):
    from vmemkv.runtime.engine import self_check as check
    model = build_model("tiny-llama")
    before = model.config._attn_implementation
    monkeypatch.setattr(check, "RTOL", {torch.float32: -1.0})      # nothing can pass
    with pytest.raises(UnsupportedModelError, match="self-check"):
        Engine(model, max_batch=2, max_context=64)
    assert model.config._attn_implementation == before


def test_closing_one_of_two_engines_on_a_model_leaves_the_other_exact():
    """The second engine must keep running on our attention: were the model switched back
    under it, its steps would attend to their own tokens only, silently."""
    model = build_model("tiny-llama")
    before = model.config._attn_implementation
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first = Engine(model, max_batch=2, max_context=64)
    expected = first.generate([[5, 17, 33, 9]], params)[0].outputs[0].token_ids
    second = Engine(model, cache="paged", max_batch=2, max_context=64)
    first.close()
    first.close()                                                # idempotent: counted once
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert second.generate([[5, 17, 33, 9]], params)[0].outputs[0].token_ids == expected
    second.close()
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("cycle", [False, True])
def test_an_engine_dropped_without_close_gives_the_model_back_to_its_own_attention(cycle):
    """Before, the model stayed on our attention for good: a plain call raised "needs
    vmemkv_step". A dropped engine is released at the model's next plain call (also one kept
    alive by a reference cycle until the collector runs); a live one still holds it."""
    model = build_model("tiny-llama")
    before = model.config._attn_implementation
    ids = torch.tensor([[5, 17, 33, 9]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    kept = Engine(model, max_batch=2, max_context=64)
    dropped = Engine(model, max_batch=2, max_context=64)
    dropped.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    if cycle:
        dropped.myself = dropped
    del dropped
    with pytest.raises(UnsupportedModelError), torch.no_grad():   # `kept` still runs on ours
        model(input_ids=ids)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert kept.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].outputs[0].token_ids
    del kept
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)
    assert model.config._attn_implementation == before
    again = Engine(model, max_batch=2, max_context=64)             # counted from zero again
    again.close()
    assert model.config._attn_implementation == before
