"""8-bit KV cache edges a hunt found untyped: a write of no tokens (IndexError from the first
write's amax, where a 16-bit cache takes it), a given scale past a float's range
(OverflowError from float(), where 1e39 is refused by name), and calibration on no tokens
(a RuntimeError from the model's embedding)."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.hf.cache import VMemCache
from vmemkv.runtime.kv_dtype import KVScales, ScaleTable, kv_encoding

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_write_of_no_tokens_fixes_no_scale_and_the_next_write_fixes_them(name):
    table = ScaleTable(kv_encoding(name, torch.float32), 2, 2, torch.device("cpu"))
    empty = torch.zeros(0, 2, 8)
    k, v = table.encode(0, empty, empty)
    assert k.shape == v.shape == (0, 2, 8) and k.dtype == v.dtype == table.encoding.storage
    assert table.fixed == [False, False] and table.unsettled == []
    x = torch.arange(48, dtype=torch.float32).view(3, 2, 8) / 10      # head amax 3.9 and 4.7
    table.encode(0, x, -x)
    want = torch.tensor([3.9, 4.7]) / table.encoding.max_value
    assert torch.allclose(table.k[0], want) and torch.allclose(table.v[0], want)
    assert table.fixed == [True, False]


def test_an_8bit_vmemcache_takes_an_update_of_no_tokens_as_a_16bit_one_does():
    """transformers' DynamicCache and an auto VMemCache take (B, H, 0, D) states; int8 raised
    IndexError. After it the cache holds nothing and the next update's values come back."""
    config = CacheConfig(**SHAPE, max_batch=1, max_context=64, kv_cache_dtype="int8")
    with VMemCache(config, page_bytes=4096) as cache, torch.no_grad():
        keys, values = cache.update(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8), 0)
        assert keys.shape == values.shape == (1, 2, 0, 8)
        assert cache.kv.cache.kv_scales.fixed == [False, False]
        x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
        keys, _ = cache.update(x, x, 0)
        step = x.abs().amax(dim=(0, 2, 3)) / 127                  # one int8 step per head
        assert ((keys - x).abs() <= step.view(1, 2, 1, 1) / 2 + 1e-6).all()


@pytest.mark.parametrize("huge", [10 ** 400, -10 ** 400, Fraction(10 ** 400, 3)],
                         ids=["int", "negative int", "fraction"])
def test_a_given_scale_past_a_floats_range_is_refused_naming_the_element(huge):
    k = [[1.0, 1.0], [1.0, huge]]
    ones = [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(CacheConfigError, match=r"kv_scales\.k\[1\]\[1\] must be a finite "
                                               r"number > 0, got -?inf"):
        CacheConfig(**SHAPE, kv_cache_dtype="int8", kv_scales=(k, ones))
    with pytest.raises(CacheConfigError, match=r"kv_scales\.v\[1\]\[1\]"):
        KVScales.of(ones, k).check(2, 2)


class _EncodesNothing:
    """A tokenizer without a chat template whose encoding of any text is no tokens."""
    chat_template = None

    def __call__(self, text):
        return {"input_ids": []}


@pytest.mark.parametrize("tokenizer, max_tokens", [(_EncodesNothing(), 256), (None, 0)],
                         ids=["tokenizer-encodes-nothing", "max-tokens-0"])
def test_calibration_on_no_tokens_is_refused_by_name(tokenizer, max_tokens):
    """It ran the model on an empty [1, 0] float tensor: a RuntimeError from the embedding."""
    from vmemkv.runtime.kv_calibration import calibrated_kv_scales
    from vmemkv.runtime.models import build_model
    model = build_model("tiny-llama", seed=0)
    with pytest.raises(CacheConfigError, match="kv_scales='calibrate': no calibration tokens"):
        calibrated_kv_scales(model, tokenizer, kv_encoding("int8", torch.float32), 2, 2,
                             max_tokens)
