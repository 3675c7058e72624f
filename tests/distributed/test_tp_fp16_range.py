"""An fp16 cache of an fp32 model under tensor parallelism: a K/V past 65504 in one rank's KV
head leaves that request failed alone and every rank in step. One process refuses the write
(NonFiniteKVError, tests/engine/test_kv_fp16_range_engine.py); a rank refusing alone would
leave the others inside the forward's collectives (the engine then died after tp_timeout_s),
so tensor-parallel ranks store it (inf) and the request fails on its logits, as before."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

from ..kv_fault_injection import POISON, VFault, poison_v

PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_a_value_past_fp16_on_one_rank_fails_its_request_alone():
    model = poison_v(build_model("tiny-llama", seed=0),
                     {POISON: (VFault(layer=0, factor=1e7, kv_heads=(1,)),)})   # rank 1's head
    options = dict(max_batch=4, max_context=64, kv_cache_dtype="fp16", tp_timeout_s=20.0)
    with Engine(model, **options) as reference:
        want = reference.generate([[5, 6, 7, 8]], PLAIN)[0].outputs[0].token_ids
    with Engine(model, tensor_parallel_size=2, **options) as engine:
        out = engine.generate([[1, 2, 3, 4, POISON], [5, 6, 7, 8]], PLAIN)
        again = engine.generate([[5, 6, 7, 8]], PLAIN)[0]      # every rank still in step
    assert out[0].status == "failed" and out[0].error.type == "NonFiniteLogitsError"
    assert out[1].outputs[0].token_ids == want and again.outputs[0].token_ids == want
