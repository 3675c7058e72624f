"""K/V holding NaN (an overflow in the model: a poison token whose V is NaN in every layer,
injected by tests/kv_fault_injection.py) on an 8-bit cache: int8 has no NaN and stored code 0,
so the request finished 'length' with made-up tokens where every other encoding failed it; and
a first write's NaN would have fixed the layer's scale to NaN for every later request. The
write is refused (NonFiniteKVError) before anything is stored or fixed: the request fails
alone, the others are exact. The same for +-inf (a poison token whose layer-0 V overflows):
int8 and both fp8s clamped it to their max and the request finished with made-up tokens where
auto/bf16/fp16 failed it, and a first write's inf gave the head the scale 1.0 for every later
request."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.kv_dtype import KVScales
from vmemkv.runtime.models import build_model

from ..kv_fault_injection import INF, NAN, POISON, VFault, poison_v

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)


FAULTS = {"nan": (VFault(layer=0, factor=NAN), VFault(layer=1, factor=NAN)),   # every V row
          "inf": (VFault(layer=0, factor=INF),)}                                 # V = +-inf


@pytest.mark.parametrize("bad, what", [("nan", "NaN"), ("inf", "+-inf")])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("given_scales", [True, False])
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_nan_kv_on_an_8bit_cache_fails_its_request_alone(kv_cache_dtype, given_scales, cache,
                                                         bad, what):
    model = poison_v(build_model("tiny-llama", seed=0), {POISON: FAULTS[bad]})
    scales = {"kv_scales": KVScales.of([[0.05, 0.07]] * 2, [[0.03, 0.04]] * 2)} \
        if given_scales else {}
    options = dict(cache=cache, max_batch=4, max_context=64, kv_cache_dtype=kv_cache_dtype,
                   **scales)
    with Engine(model, **options) as reference:       # the base requests alone, in order
        want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS[1:2], PLAIN)]
        want += [o.outputs[0].token_ids for o in reference.generate(PROMPTS[2:], PLAIN)]
        want_v = reference.kv.cache.kv_scales.v.clone()
    with Engine(model, **options) as engine:
        first = engine.generate([PROMPTS[0] + [POISON], PROMPTS[1]], PLAIN)
        later = engine.generate(PROMPTS[2:], PLAIN)      # the scales are not NaN nor 1.0
        assert torch.equal(engine.kv.cache.kv_scales.v, want_v)
    assert first[0].status == "failed" and first[0].error.type == "NonFiniteKVError"
    assert f"holds {what}" in first[0].error.message and first[0].outputs[0].token_ids == []
    assert [first[1].outputs[0].token_ids, later[0].outputs[0].token_ids] == want
