"""VMemCache's ``crop`` on a windowed model goes back as far as the memory really given back
allows (not only to the last forward's start), and a forward under autograd is refused by name.
Geometry: fp32, 2 KV heads x 16, 4 KiB pages = 32 tokens of one layer's K or V; a row's page
group is 2 x layers pages; tiny random-weight models with a window of 8 (window_families)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf import VMemCache

from .test_window_models import prompts
from .window_families import build

PAGE_BYTES, LAYERS, HEADS, DIMS = 4096, 2, 2, 16
GROUP_PAGES = 2 * LAYERS                       # a row's K and V pages of every layer


def greedy(model, ids: torch.Tensor, new: int, cache=None) -> torch.Tensor:
    """transformers' greedy tokens (eos off), on ``cache`` or, without one, its own."""
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            extra = {} if cache is None else {"past_key_values": cache}
            return model.generate(ids, max_new_tokens=new, do_sample=False, **extra)
    finally:
        model.generation_config.eos_token_id = saved


@pytest.mark.parametrize("new, crop", [
    (10, -9),       # 29 cached on page 0: nothing went back (the old bound was 28: 1 token)
    (60, -8),       # 79 cached: pages 0-1 went back; a query at 71 reads 64..71 (page 2)
])
def test_a_crop_the_given_back_memory_allows_continues_as_transformers(new, crop):
    model = build("mistral")                                  # every layer windowed (8)
    prompt = torch.tensor(prompts(1, 20, 20, seed=7))
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=128,
                                     page_bytes=PAGE_BYTES) as cache:
        out = greedy(model, prompt, new, cache)
        assert cache.stats().mapped_pages == 2 * LAYERS       # one page: K and V of 2 layers
        cache.crop(crop)
        kept = cache.get_seq_length()
        assert kept == 20 + new - 1 + crop
        got = greedy(model, out[:, :kept + 1], 12, cache)
    assert torch.equal(got, greedy(model, out[:, :kept + 1], 12))


def test_crop_below_the_given_back_page_is_refused_and_a_reorder_and_copy_read_to_its_bound():
    """50 cached, the last query at 49 read keys from 34 on: page 0 (tokens [0, 32)) went back
    and page 1 stays, so crop may leave 47 (a query there reads 32..47), not 46. A beam reorder
    before the crop moves keys 32 and 33 too, and a deep copy holds them."""
    window = 16
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIMS,
                         dtype=torch.float32, max_batch=2, max_context=128,
                         layer_windows=(window, window))
    g = torch.Generator().manual_seed(5)
    written = []                                  # the top layer's keys: (B, H, T, D)

    def step(cache, tokens, keys=None):
        keys = torch.randn(2, HEADS, tokens, DIMS, generator=g) if keys is None else keys
        for layer in range(LAYERS):
            seen, _ = cache.update(keys, -keys, layer)
        return keys, seen

    with VMemCache(config, page_bytes=PAGE_BYTES) as cache:
        for tokens in [40] + [1] * 10:
            written.append(step(cache, tokens)[0])
        assert cache.stats().mapped_pages == 2 * GROUP_PAGES        # page 1 of both rows
        with pytest.raises(CacheStateError,
                           match=r"tokens \[0, 32\) was given back.*crop at most 3 tokens"):
            cache.crop(-4)
        assert cache.get_seq_length() == 50
        cache.reorder_cache(torch.tensor([1, 0]))
        with copy.deepcopy(cache) as twin:
            new = torch.randn(2, HEADS, 1, DIMS, generator=g)
            for held in (cache, twin):
                held.crop(-3)
                assert held.get_seq_length() == 47
                _, seen = step(held, 1, new)                  # a query at 47 reads 32..47
                want = torch.cat(written, dim=2)[[1, 0], :, 32:48]   # rows as reordered
                want[:, :, -1] = new[:, :, 0]                 # the new token: not reordered
                assert seen.shape == (2, HEADS, window, DIMS) and torch.equal(seen, want)


def test_update_under_autograd_is_refused_by_name_and_writes_nothing():
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIMS,
                         dtype=torch.float32, max_batch=1, max_context=64)
    keys = torch.randn(1, HEADS, 5, DIMS, requires_grad=True)
    with VMemCache(config, page_bytes=PAGE_BYTES) as cache:
        with pytest.raises(CacheStateError, match="inference only.*require grad"):
            cache.update(keys, keys, 0)
        assert (cache.get_seq_length(), cache.batch_size, cache.stats().mapped_pages) == (0, -1, 0)
        with torch.no_grad():                                 # the same states, no autograd
            seen, _ = cache.update(keys, keys, 0)
        assert cache.get_seq_length() == 5 and torch.equal(seen, keys.detach())


def test_a_model_forward_under_autograd_is_refused_then_runs_under_no_grad():
    model = build("mistral")
    ids = torch.tensor(prompts(1, 12, 12, seed=4))
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=64) as cache:
        with torch.enable_grad(), pytest.raises(CacheStateError, match="inference only"):
            model(ids, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 0 and cache.stats().mapped_pages == 0
        with torch.no_grad():
            got = model(ids, cache=cache, use_cache=True).logits
            want = model(ids).logits
    torch.testing.assert_close(got, want)
