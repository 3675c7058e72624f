"""Scales given as a ``(k, v)`` pair of nested lists (CacheConfig takes one, and a one-process
engine did) run under tensor parallelism too: rank 0 took its columns of the raw pair and
raised AttributeError ('tuple' object has no attribute 'k'); it takes them of the checked
KVScales, as the other ranks did, and gives the one-process engine's tokens."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.kv_dtype import KVScales

from ..engine.conftest import model

SCALES = [[0.05, 0.07], [0.06, 0.04]]      # [layer][KV head] of tiny-llama (2 x 2)


def _tokens(world: int):
    with Engine(model("tiny-llama"), max_batch=2, max_context=64, tensor_parallel_size=world,
                kv_cache_dtype="int8", kv_scales=(SCALES, SCALES)) as engine:
        out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=6))
        return [o.outputs[0].token_ids for o in out], engine.cache_config.kv_scales


def test_a_scales_pair_runs_under_tp_with_one_process_tokens():
    one, scales1 = _tokens(1)
    two, scales2 = _tokens(2)
    assert scales1 == KVScales.of(SCALES, SCALES)
    assert scales2 == KVScales.of([[0.05], [0.06]], [[0.05], [0.06]])   # rank 0: KV head 0
    assert two == one
