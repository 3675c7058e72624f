"""VMemCache's state across a copy, a failed update, a reset, and construction under
``torch.inference_mode``: a windowed copy holds what the original holds (same pages, same
budget); an update that raises changes nothing; ``reset()`` leaves a cache a fresh one's equal
(first-write 8-bit scales unfixed, given ones kept); a cache built in inference mode serves plain
``generate``; GPT-NeoX-Japanese (which ``view``s the keys) runs at batch 2."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from vmemkv.runtime.hf import VMemCache
from vmemkv.runtime.kv_dtype import KVScales, NonFiniteKVError
from vmemkv.runtime.models import build_model

transformers = pytest.importorskip("transformers")

PAGE = 4096          # 32 tokens of one layer's K or V (2 kv heads x 16 dims, fp32)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()


def greedy(model, ids, new=5, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")        # past_key_values= is deprecated in 5.x
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              eos_token_id=None, **kwargs)


def fill_and_copy(model, cache, vocab):
    """200 tokens a row, 20 at a time, then a copy; the logits of 3 more tokens on each."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(10):
            ids = torch.randint(3, vocab, (2, 20), generator=gen)
            mask = torch.ones(2, cache.get_seq_length() + 20, dtype=torch.long)
            model(ids, attention_mask=mask, past_key_values=cache)
        twin = copy.deepcopy(cache)
        mine, its = cache.stats(), twin.stats()
        assert (its.seq_len, its.mapped_pages, its.committed_bytes, its.budget_bytes) == \
            (mine.seq_len, mine.mapped_pages, mine.committed_bytes, mine.budget_bytes)
        nxt = torch.tensor([[11, 12, 13], [14, 15, 16]])
        mask = torch.ones(2, 203, dtype=torch.long)
        a = model(nxt, attention_mask=mask, past_key_values=twin).logits
        b = model(nxt, attention_mask=mask, past_key_values=cache).logits
    assert torch.equal(a, b)
    assert twin.stats().mapped_pages == cache.stats().mapped_pages
    twin.close()
    cache.close()


def test_a_windowed_copy_maps_what_the_original_holds_and_fits_its_budget():
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)).eval()
    budget = 2 * 2 * 2 * 3 * PAGE             # 3 pages per row, layer, K/V: the window's
    fill_and_copy(model, VMemCache.from_model_config(model.config, max_batch=2, max_context=1024,
                                                     page_bytes=PAGE, cache_bytes=budget), 100)


@pytest.mark.parametrize("label", ["cohere2", "gemma3"])
def test_a_hybrids_copy_maps_what_the_original_holds(label):
    from .window_families import build
    model = build(label)
    fill_and_copy(model, VMemCache.from_model_config(model.config, max_batch=2, max_context=256,
                                                     page_bytes=PAGE), 100)


def test_a_cache_built_in_inference_mode_serves_plain_generate():
    model = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=64)
    with cache:
        assert torch.equal(greedy(model, ids, past_key_values=cache), greedy(model, ids))


def nan_embeddings(model):
    bad = model.get_input_embeddings()(torch.tensor([[5, 6, 7, 8]])).detach().clone()
    bad[0, 2, :] = float("nan")
    return bad


def assert_as_new(cache):
    s = cache.stats()
    assert (s.batch, s.seq_len, cache.get_seq_length(), cache._rows) == (0, 0, 0, [])
    assert cache.kv.cache.kv_scales.fixed == [False, False]
    assert cache.manager.stats().free_tokens + cache.manager.reclaimable_tokens == \
        cache.max_batch * cache.kv.geometry.round_up_tokens(cache.max_context)


def test_an_update_refused_at_encode_changes_nothing():
    model = llama()
    cache = VMemCache.from_model_config(model.config, max_batch=4, max_context=64,
                                        kv_cache_dtype="int8")
    with pytest.raises(NonFiniteKVError):
        greedy(model, None, inputs_embeds=nan_embeddings(model), past_key_values=cache)
    assert_as_new(cache)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])       # another batch size runs
    with VMemCache.from_model_config(model.config, max_batch=4, max_context=64,
                                     kv_cache_dtype="int8") as fresh:
        assert torch.equal(greedy(model, ids, past_key_values=cache),
                           greedy(model, ids, past_key_values=fresh))
    cache.close()


def test_an_update_whose_copy_raises_gives_back_the_rows_it_claimed():
    model = llama()
    cache = VMemCache.from_model_config(model.config, max_batch=4, max_context=64,
                                        kv_cache_dtype="int8")

    def broken(layer):
        raise RuntimeError("copy failed")
    cache.kv.layer_tensors, real = broken, cache.kv.layer_tensors
    with pytest.raises(RuntimeError, match="copy failed"):
        greedy(model, torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
    assert_as_new(cache)
    cache.kv.layer_tensors = real
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    assert torch.equal(greedy(model, ids, past_key_values=cache), greedy(model, ids))
    cache.close()


def test_reset_unfixes_first_write_scales_and_keeps_given_ones():
    model = build_model("tiny-llama")
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))

    def logits(cache):
        with torch.no_grad():
            return model(prompt, past_key_values=cache).logits

    with VMemCache.from_model_config(model.config, max_batch=1, max_context=128,
                                     kv_cache_dtype="int8") as fresh:
        want = logits(fresh)
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=128,
                                     kv_cache_dtype="int8") as reused:
        with torch.no_grad():
            model(torch.tensor([[3]]), past_key_values=reused)   # a warm-up fixes the scales
        reused.reset()
        assert not any(reused.kv.cache.kv_scales.fixed)
        assert torch.equal(logits(reused), want)
    # scales the user gives are the encoding: reset keeps them
    layers, heads = reused.config.num_layers, reused.config.num_kv_heads
    given = KVScales.of([[0.05] * heads] * layers, [[0.07] * heads] * layers)
    config = dataclasses.replace(reused.config, kv_scales=given)
    with VMemCache(config) as fixed:
        logits(fixed)
        fixed.reset()
        assert all(fixed.kv.cache.kv_scales.fixed)
        assert fixed.kv.cache.kv_scales.k.eq(0.05).all() and fixed.kv.cache.kv_scales.v.eq(0.07).all()


def test_gpt_neox_japanese_runs_at_batch_two_and_other_families_keep_views():
    torch.manual_seed(0)
    model = transformers.GPTNeoXJapaneseForCausalLM(transformers.GPTNeoXJapaneseConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_multiple_size=2, max_position_embeddings=256)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    with VMemCache.from_model_config(model.config, max_batch=4, max_context=64) as cache:
        assert torch.equal(greedy(model, ids, past_key_values=cache), greedy(model, ids))
    with VMemCache.from_model_config(llama().config, max_batch=2, max_context=64) as cache:
        k = torch.randn(2, 2, 3, 16)
        keys, _ = cache.update(k, k, 0)
        assert keys.data_ptr() == cache.kv.layer_tensors(0)[0].data_ptr()   # a view, no copy
