"""VMemCache as transformers' code and its users read it (hunt 31): what ``layers[i].keys`` /
``.values`` hold after ``crop`` and ``reorder_cache`` agrees with the cache's own length and rows,
as a DynamicCache's does. Tiny random-weight Llama, nothing downloaded."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.hf import VMemCache  # noqa: E402

IDS = torch.tensor([[3, 2, 7, 8, 9], [1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()


def filled(model, cache):
    with torch.no_grad():
        model(IDS, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_layer_keys_after_crop_are_the_tokens_kept(llama, kv_cache_dtype):
    """They kept all 5 tokens after crop(-2) (DynamicCache's hold 3): a reader of
    ``layers[i].keys`` saw tokens the cache no longer holds."""
    cache = filled(llama, VMemCache.from_model_config(llama.config, max_batch=2, max_context=64,
                                                      kv_cache_dtype=kv_cache_dtype))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    for layer, (keys, values) in zip(cache.layers, before):
        assert layer.keys.shape == layer.values.shape == (2, 2, 3, 16)
        assert torch.equal(layer.keys, keys[:, :, :3])
        assert torch.equal(layer.values, values[:, :, :3])
    cache.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "bf16"])
def test_decoded_layer_keys_follow_a_reorder(llama, kv_cache_dtype):
    """K/V stored in another dtype are handed out as decoded copies; after reorder_cache they
    still showed the rows before it (a DynamicCache's are reordered)."""
    cache = filled(llama, VMemCache.from_model_config(llama.config, max_batch=2, max_context=64,
                                                      kv_cache_dtype=kv_cache_dtype))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    cache.reorder_cache(torch.tensor([1, 1]))
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[[1, 1]])
        assert torch.equal(layer.values, values[[1, 1]])
    cache.close()


def test_a_page_too_large_for_any_context_is_refused_naming_page_bytes(llama):
    """A 4 GiB page holds 2**25 tokens of this model's layer: max_context=64 rounded up to whole
    pages passed the CacheConfig limit, and the error named ``max_context ... got 33554432``, a
    value the caller never gave, instead of page_bytes."""
    from vmemkv.runtime.errors import CacheConfigError
    with pytest.raises(CacheConfigError, match=r"page_bytes=4294967296 makes pages of 33554432 "
                                               r"tokens, so max_context=64 rounds up"):
        VMemCache.from_model_config(llama.config, max_batch=2, max_context=64,
                                    page_bytes=1 << 32)
