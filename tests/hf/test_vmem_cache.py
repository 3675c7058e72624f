"""VMemCache: plain ``model.generate`` on the vmem layout, checked against transformers' own cache.

Random-weight tiny models built from configs (nothing is downloaded). Pages of 4 KiB hold 32
tokens of one layer's K (or V): 2 kv heads * 16 dims * 4 bytes = 128 bytes per token.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.errors import CacheStateError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402
from vmemkv.runtime.hf.cache import (BatchTooLargeError, CacheCapacityError,  # noqa: E402
                              ContextOverflowError)

PAGE, TOKENS_PER_PAGE, LAYERS = 4096, 32, 2
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0)
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def build(family: str):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**SHAPE)).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def batch(lengths, width=None, seed=1):
    """Left-padded prompts of the given lengths: (input_ids, attention_mask), both (B, width)."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, SHAPE["vocab_size"], (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def greedy(model, ids, mask, new=20, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          min_new_tokens=new, **kwargs)


def vmem_cache(model, max_batch=4, max_context=64, **kwargs):
    return VMemCache.from_model_config(model.config, max_batch=max_batch, max_context=max_context,
                                       page_bytes=PAGE, **kwargs)


def expected_pages(rows, tokens):
    return rows * -(-tokens // TOKENS_PER_PAGE) * 2 * LAYERS      # K and V of every layer


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_greedy_is_token_identical_to_default_cache_mixed_lengths(model, layout):
    ids, mask = batch([12, 5, 9, 1])
    with vmem_cache(model, layout=layout) as cache:
        got = greedy(model, ids, mask, cache=cache)
        cache.manager.check_integrity()
    assert torch.equal(got, greedy(model, ids, mask))


def test_past_key_values_keyword_works(llama):
    ids, mask = batch([7, 3])
    with vmem_cache(llama) as cache, pytest.warns(FutureWarning):
        got = greedy(llama, ids, mask, new=5, past_key_values=cache)
    assert torch.equal(got, greedy(llama, ids, mask, new=5))


def test_returned_kv_are_views_of_the_virtual_range(llama):
    ids, mask = batch([6, 4])
    with vmem_cache(llama) as cache:
        with torch.no_grad():                                        # inference only
            llama(input_ids=ids, attention_mask=mask, cache=cache)
        lo, hi = cache.kv.range.address, cache.kv.range.address + cache.kv.range.size_bytes
        for layer in range(LAYERS):
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            assert keys.shape == (2, 2, 6, 16)                       # (B, kv_heads, L, head_dim)
            for t in (keys, values):
                assert lo <= t.data_ptr() < hi
            backing = cache.kv._k[layer]
            assert keys.untyped_storage().data_ptr() == backing.untyped_storage().data_ptr()
            backing[1, 5, 0, 0] += 1.0                               # aliasing: no copy in between
            assert keys[1, 0, 5, 0] == backing[1, 5, 0, 0]


def test_pages_are_mapped_only_as_the_sequence_grows(llama):
    seen = []

    class Record(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append((cache.stats().seq_len, cache.stats().mapped_pages))
            return scores

    ids, mask = batch([20, 11, 3])
    with vmem_cache(llama, max_context=128) as cache:
        assert cache.stats().mapped_pages == 0
        greedy(llama, ids, mask, new=50, cache=cache,
               logits_processor=transformers.LogitsProcessorList([Record()]))
    assert seen[0] == (20, expected_pages(3, 20))
    assert all(pages == expected_pages(3, tokens) for tokens, pages in seen)
    assert seen[-1][1] == expected_pages(3, 69) > seen[0][1]       # crossed two page boundaries


def test_reuse_across_generate_calls_maps_no_new_pages(llama):
    first, second = batch([12, 5, 9]), batch([4, 8], seed=2)
    with vmem_cache(llama) as cache:
        assert torch.equal(greedy(llama, *first, cache=cache), greedy(llama, *first))
        mapped = cache.stats().mapped_pages
        cache.reset()
        assert torch.equal(greedy(llama, *second, cache=cache), greedy(llama, *second))
        assert cache.stats().mapped_pages == mapped and cache.stats().batch == 2
        cache.reset()
        assert torch.equal(greedy(llama, *first, cache=cache), greedy(llama, *first))
        assert cache.stats().mapped_pages == mapped
        cache.manager.check_integrity()


def test_continuing_generation_without_reset_matches_one_long_call(llama):
    ids, mask = batch([10, 4])
    with vmem_cache(llama) as cache:
        head = greedy(llama, ids, mask, new=8, cache=cache)
        mask = torch.cat([mask, torch.ones((2, 8), dtype=mask.dtype)], dim=1)
        whole = greedy(llama, head, mask, new=8, cache=cache)
    assert torch.equal(whole, greedy(llama, ids, batch([10, 4])[1], new=16))


def test_beam_search_reorders_rows_in_place(llama):
    ids, mask = batch([9, 6])
    with vmem_cache(llama, max_batch=4) as cache:
        got = greedy(llama, ids, mask, new=10, num_beams=2, cache=cache)
    assert torch.equal(got, greedy(llama, ids, mask, new=10, num_beams=2))


def test_local_checkpoint_directory(llama, tmp_path):
    llama.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = batch([7, 2, 5])
    with VMemCache.from_model_config(loaded.config, max_batch=3, max_context=48) as cache:
        assert torch.equal(greedy(loaded, ids, mask, cache=cache), greedy(llama, ids, mask))


def test_max_context_need_not_be_whole_pages(llama):
    with vmem_cache(llama, max_context=40) as cache:
        assert cache.max_cache_len == 40 and cache.kv.config.max_context == 64
        ids, mask = batch([10, 10])
        assert torch.equal(greedy(llama, ids, mask, new=30, cache=cache), greedy(llama, ids, mask, new=30))


def test_batch_too_large_is_typed_and_changes_nothing(llama):
    ids, mask = batch([3, 4, 5])
    with vmem_cache(llama, max_batch=2) as cache:
        with pytest.raises(BatchTooLargeError, match=r"batch of 3 rows exceeds .*max_batch=2"):
            greedy(llama, ids, mask, cache=cache)
        assert cache.stats().mapped_pages == 0 and cache.stats().batch == 0
        assert cache.manager.stats().live_tokens == 0
        assert torch.equal(greedy(llama, ids[:2], mask[:2], cache=cache), greedy(llama, ids[:2], mask[:2]))


def test_growing_past_max_context_is_typed_and_changes_nothing(llama):
    ids, mask = batch([12, 6])
    with vmem_cache(llama, max_context=16) as cache:
        with pytest.raises(ContextOverflowError, match=r"length 17 exceeds .*max_context=16"):
            greedy(llama, ids, mask, cache=cache)
        s = cache.stats()
        assert (s.batch, s.seq_len, s.mapped_pages) == (2, 16, expected_pages(2, 16))
        assert cache.get_seq_length() == 16 and cache.manager.num_tokens(cache._rows[0]) == 16
        cache.manager.check_integrity()
        cache.reset()
        assert torch.equal(greedy(llama, ids, mask, new=4, cache=cache), greedy(llama, ids, mask, new=4))


def test_page_budget_exhausted_is_typed_and_changes_nothing(llama):
    ids, mask = batch([12, 6])
    group = 2 * LAYERS * PAGE                     # one page of K and V in every layer
    with vmem_cache(llama, max_context=128, cache_bytes=3 * group) as cache:
        with pytest.raises(CacheCapacityError, match=r"needs 2 page groups .* has 1 left"):
            greedy(llama, ids, mask, new=30, cache=cache)   # 2 rows cross into page 2 at 33
        s = cache.stats()
        assert (s.batch, s.seq_len, s.mapped_pages) == (2, 32, expected_pages(2, 32))
        cache.manager.check_integrity()


def test_misuse_is_typed(llama):
    ids, mask = batch([3, 4])
    cache = vmem_cache(llama)
    greedy(llama, ids, mask, new=2, cache=cache)
    with pytest.raises(CacheStateError, match=r"reset\(\)"):          # new batch without reset
        greedy(llama, ids[:1], mask[:1], new=2, cache=cache)
    cache.close()
    with pytest.raises(CacheStateError, match="after close"):
        greedy(llama, ids, mask, new=2, cache=cache)
    with vmem_cache(llama, dtype=torch.float16) as half:
        with pytest.raises(CacheStateError, match="float32"):
            greedy(llama, ids, mask, new=2, cache=half)
        assert half.stats().mapped_pages == 0


GROW_FAULT = r"""
import torch
from vmemkv import vmem
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.runtime.hf import VMemCache
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

driver = FaultInjectingDriver(HostDriver())
vmem.open_driver = lambda *args, **kwargs: driver          # the cache builds on the faulty driver
config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=64)
cache = VMemCache(config, page_bytes=4096)                 # 32 tokens per page
k = torch.randn(2, 2, 40, 16)                              # two rows of 40 tokens: two pages each
v = torch.randn(2, 2, 40, 16)
import dataclasses
def state():   # the pool grows on demand and keeps what it created: committed bytes may rise
    return (cache.manager.stats(), dataclasses.replace(cache.stats(), committed_bytes=0),
            driver.mapped_addresses)
before = state()
driver.fail_at("map", 3)                                   # a map part-way through the growth
try:
    cache.update(k, v, 0)
    raise SystemExit("the failed map did not raise")
except PlanExecutionError:
    pass
assert state() == before, "state changed"
assert cache.stats().committed_bytes <= cache.stats().budget_bytes
cache.manager.check_integrity()
keys, values = cache.update(k, v, 0)                       # the next call grows again and works
assert torch.equal(keys, k) and torch.equal(values, v)
keys, values = cache.update(k, v, 1)
assert torch.equal(keys, k) and torch.equal(values, v)
cache.kv.check_integrity()
cache.close()
print("ok")
"""


def test_failed_map_while_growing_raises_changes_nothing_and_the_next_update_works():
    """A page map that fails during growth used to leave the manager grown: the retry skipped
    growing and wrote into unmapped memory (SIGSEGV). Run in a subprocess so a crash is a
    failure of this test, not of the whole run."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", GROW_FAULT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_deep_copy_serves_transformers_prompt_reuse_recipe(kv_cache_dtype):
    """transformers' recipe: fill a cache with a shared prefix once, then ``copy.deepcopy`` it
    for each continuation. The copy has memory of its own (the original stays as it was) and
    continues as the original would (8-bit: with the scales its first write fixed)."""
    import copy
    model = build("llama")
    prefix = [5, 17, 33, 9, 41, 77, 12]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=64,
                                     kv_cache_dtype=kv_cache_dtype) as prompt_cache, \
            torch.inference_mode():
        model(torch.tensor([prefix]), cache=prompt_cache)
        for suffix in ([4, 6], [10, 11, 2]):
            ids = torch.tensor([prefix + suffix])
            with copy.deepcopy(prompt_cache) as past:
                assert past.kv.range.address != prompt_cache.kv.range.address
                got = model.generate(ids, cache=past, **options)
            if kv_cache_dtype == "auto":
                want = model.generate(ids, **options)
            else:                                   # the original, continued once at the end
                want = got if suffix != [10, 11, 2] else model.generate(ids, cache=prompt_cache,
                                                                         **options)
            assert got.tolist() == want.tolist()
            if suffix == [4, 6]:
                assert prompt_cache.get_seq_length() == len(prefix)    # untouched by the copy


def test_a_deep_copy_of_a_windowed_cache_continues_exactly():
    """Mistral (window 8) on 4 KiB pages: the prefix's early pages were given back; the copy
    holds what the window still reads and continues as plain generate does."""
    import copy

    from .window_families import build as build_windowed
    model = build_windowed("mistral")
    prefix = list(range(3, 43))                                     # 40 tokens: 5 windows
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=128,
                                     page_bytes=4096) as prompt_cache, torch.inference_mode():
        model(torch.tensor([prefix[:30]]), cache=prompt_cache)
        model(torch.tensor([prefix[30:]]), cache=prompt_cache)      # slides past page 0
        ids = torch.tensor([prefix + [50, 60]])
        with copy.deepcopy(prompt_cache) as past:
            got = model.generate(ids, cache=past, **options)
        want = model.generate(ids, **options)
    assert got.tolist() == want.tolist()
