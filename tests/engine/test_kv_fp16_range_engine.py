"""An fp16 cache of a wider model (``kv_cache_dtype="fp16"`` on fp32 or bf16) stored a K/V past
65504 as inf: attention gave NaN and the request failed on its logits
(NonFiniteLogitsError, whose hint blames the model's own overflow), where VMemCache refused the
same write by name. The engine's caches refuse it too: the request fails alone with
NonFiniteKVError naming the value and the storage, nothing of it written, and the others'
tokens are exact."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

from ..kv_fault_injection import POISON, VFault, poison_v

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8]]
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_value_past_fp16s_range_fails_its_request_alone_naming_the_storage(cache):
    model = build_model("tiny-llama", seed=0)          # fp32
    poison_v(model, {POISON: (VFault(layer=0, factor=1e7),)})   # V far past 65504, finite
    options = dict(cache=cache, max_batch=4, max_context=64, kv_cache_dtype="fp16")
    with Engine(model, **options) as reference:
        want = reference.generate(PROMPTS[1:], PLAIN)[0].outputs[0].token_ids
    with Engine(model, **options) as engine:
        out = engine.generate([PROMPTS[0] + [POISON], PROMPTS[1]], PLAIN)
    assert out[0].status == "failed" and out[0].error.type == "NonFiniteKVError", out[0].error
    assert "past 65504" in out[0].error.message and "kv_cache_dtype='fp16'" in \
        out[0].error.message
    assert out[1].status == "finished" and out[1].outputs[0].token_ids == want
