"""8-bit KV caches (``kv_cache_dtype``), hunt 31: a KV head that a layer's first write leaves
all 0 stays open (scale 0: its stored 0s decode to 0 under any scale) and the first write that
reaches it fixes its scale (it got 1.0, so int8 stored every later value of that head below
0.5 as 0); a rolled-back write that fixed an open head reopens it; a copy of a VMemCache keeps
its open heads. ``KVScales(k, v)`` built directly is the value ``KVScales.of`` makes (it kept
str, True and 1e-50, which the cache's fp32 table held as 0)."""
from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf.cache import VMemCache
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_dtype import KVScales, ScaleTable, kv_encoding
from vmemkv.runtime.models import build_model

EIGHT_BIT = ("int8", "fp8_e4m3", "fp8_e5m2")


def table(name: str) -> ScaleTable:
    """One layer of 2 KV heads, scales fixed at the first write."""
    return ScaleTable(kv_encoding(name, torch.float32), 1, 2, torch.device("cpu"))


def head_1_only(value: float = 1.0) -> torch.Tensor:
    """[tokens 3, kv_heads 2, head_dim 4]: head 0 all 0, head 1 ``value``."""
    x = torch.zeros(3, 2, 4)
    x[:, 1] = value
    return x


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_a_head_the_first_write_leaves_zero_is_fixed_by_the_first_write_that_reaches_it(name):
    scales = table(name)
    scales.encode(0, head_1_only(), head_1_only())
    max_value = scales.encoding.max_value
    assert scales.k[0, 1].item() == pytest.approx(1.0 / max_value)
    x = torch.full((1, 2, 4), 0.3)
    k, v = scales.encode(0, x, x)
    for stored, row in ((k, scales.k[0]), (v, scales.v[0])):
        decoded = scales.encoding.dequantize(stored, row)
        assert decoded[0, 0].tolist() == pytest.approx([0.3] * 4, rel=0.07)   # int8: it was 0
    assert scales.k[0].tolist() == pytest.approx([0.3 / max_value, 1.0 / max_value])
    assert scales.fixed == [True]


def test_an_open_heads_earlier_zeros_still_decode_to_zero_after_it_is_fixed():
    scales = table("int8")
    first_k, _ = scales.encode(0, head_1_only(), head_1_only())
    scales.encode(0, torch.full((1, 2, 4), 5.0), torch.full((1, 2, 4), 5.0))
    decoded = scales.encoding.dequantize(first_k, scales.k[0])
    assert decoded[:, 0].abs().max().item() == 0.0
    assert decoded[:, 1].reshape(-1).tolist() == pytest.approx([1.0] * 12)   # head 1's scale


def test_a_rolled_back_write_that_fixed_an_open_head_reopens_it():
    scales = table("int8")
    scales.encode(0, head_1_only(), head_1_only())
    scales.settle()                                     # the first write was kept
    scales.encode(0, torch.full((1, 2, 4), 12.7), torch.full((1, 2, 4), 1.27))   # not kept
    assert scales.k[0, 0].item() == pytest.approx(0.1)
    assert scales.unfix_unsettled() == [0]
    assert scales.k[0].tolist() == pytest.approx([0.0, 1.0 / 127])   # head 0 open again
    assert scales.fixed == [True]
    scales.encode(0, torch.full((1, 2, 4), 2.54), torch.full((1, 2, 4), 2.54))
    assert scales.k[0].tolist() == pytest.approx([0.02, 1.0 / 127])
    assert scales.v[0].tolist() == pytest.approx([0.02, 1.0 / 127])
    scales.settle()
    assert scales.unfix_unsettled() == [] and scales.k[0, 0].item() == pytest.approx(0.02)


def test_a_head_that_stays_zero_stays_open_and_stores_zeros_and_unfix_resets_it():
    scales = table("int8")
    scales.encode(0, head_1_only(), head_1_only())
    k, _ = scales.encode(0, head_1_only(2.0), head_1_only(2.0))   # head 0 still 0: still open
    assert scales.k[0].tolist() == pytest.approx([0.0, 1.0 / 127])   # 0: open, not 1.0
    assert k[:, 0].tolist() == [[0] * 4] * 3 and k[:, 1].tolist() == [[127] * 4] * 3
    scales.unfix(0)
    assert scales.fixed == [False] and scales.k[0].tolist() == [1.0, 1.0]
    scales.encode(0, torch.full((1, 2, 4), 1.27), torch.full((1, 2, 4), 1.27))
    assert scales.k[0].tolist() == pytest.approx([0.01, 0.01])


@functools.lru_cache(maxsize=None)
def zero_token_model():
    """tiny-llama whose token 0 embeds to 0: a prompt of 0s writes K = V = 0 in every layer
    (RMSNorm of 0 is 0, no biases)."""
    model = build_model("tiny-llama", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight[0] = 0
    return model


def greedy(cache: str, after_zero_prompt: bool) -> tuple:
    rng = random.Random(3)
    prompt = [rng.randrange(1, 256) for _ in range(12)]
    with Engine(zero_token_model(), cache=cache, kv_cache_dtype="int8", max_batch=2,
                max_context=64, self_check=False) as engine:
        if after_zero_prompt:    # its forward reads the open heads (scale 0) it wrote
            zero = engine.generate([[0] * 8], SamplingParams(max_new_tokens=2, logprobs=0))[0]
            assert zero.status == "finished" and len(zero.outputs[0].token_ids) == 2
        out = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
        scales = engine.kv.cache.kv_scales
        return out[0].outputs[0].token_ids, scales.k.tolist(), scales.v.tolist()


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_an_int8_engine_whose_first_prompt_writes_zero_kv_serves_the_next_as_a_fresh_one(cache):
    """The zero prompt fixed every scale at 1.0: the next prompt's K/V rounded to 0 and it
    generated other tokens (105, 72, 46, ... instead of 222, 5, 10, ...)."""
    assert greedy(cache, after_zero_prompt=True) == greedy(cache, after_zero_prompt=False)


def vmem_cache_logits(kv_cache_dtype: str, copy_after_zeros: bool) -> torch.Tensor:
    """Logits of 12 tokens after 4 zero tokens (K = V = 0 in every layer) in a VMemCache, or in
    a ``copy.deepcopy`` of it taken after the zeros."""
    model = zero_token_model()
    rng = random.Random(3)
    ids = torch.tensor([[rng.randrange(1, 256) for _ in range(12)]])
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=64,
                                     kv_cache_dtype=kv_cache_dtype) as cache, torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), past_key_values=cache)
        if not copy_after_zeros:
            return model(ids, past_key_values=cache).logits
        with copy.deepcopy(cache) as twin:
            return model(ids, past_key_values=twin).logits


def test_a_vmemcache_and_its_copy_fix_the_open_heads_at_the_first_write_that_reaches_them():
    """int8 after a zero write: logits within 0.3 of auto's (they were 2.77 off); the copy's
    the same as the original's (the open heads travel with the scales it copies)."""
    want = vmem_cache_logits("auto", copy_after_zeros=False)
    got = vmem_cache_logits("int8", copy_after_zeros=False)
    assert (got - want).abs().max().item() < 0.3
    assert torch.equal(vmem_cache_logits("int8", copy_after_zeros=True), got)


def test_kvscales_built_directly_is_the_same_value_as_of():
    """``KVScales(k, v)`` (a dataclass: the constructor is public) kept lists as given: not the
    value ``of`` makes of the same numbers (another digest, so another prefix key)."""
    k, v = [[0.1, 0.01]] * 2, torch.full((2, 2), 0.02)
    direct = KVScales(k, v)
    assert direct == KVScales.of(k, v) and direct.digest == KVScales.of(k, v).digest
    assert direct.k == ((0.10000000149011612, 0.009999999776482582),) * 2


@pytest.mark.parametrize("bad, message", [
    ("0.01", r"kv_scales\.k must be \[num_layers\]\[num_kv_heads\] numbers"),     # TypeError
    (True, r"kv_scales\.k must be \[num_layers\]\[num_kv_heads\] numbers"),       # taken as 1.0
])
def test_kvscales_built_directly_refuses_what_of_refuses_by_name(bad, message):
    with pytest.raises(CacheConfigError, match=message):
        KVScales([[bad, 0.01]] * 2, [[0.01, 0.01]] * 2)


def test_a_given_scale_below_fp32s_range_is_refused_not_stored_as_zero():
    """1e-50 passed ``check`` as given and the fp32 table held 0 (x / 0: inf, saturated)."""
    scales = KVScales([[1e-50, 0.01]] * 2, [[0.01, 0.01]] * 2)
    with pytest.raises(CacheConfigError, match=r"kv_scales\.k\[0\]\[0\] must be a finite number "
                                               r"> 0, got 0\.0"):
        Engine(build_model("tiny-llama", seed=0), kv_cache_dtype="int8", kv_scales=scales,
               max_batch=2, max_context=64, self_check=False)
