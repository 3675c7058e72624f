"""``model.generate`` with a VMemCache on a sliding-window or hybrid model gives back the memory
behind the window: its windowed layers report ``is_sliding`` and return only the keys of the
window (the mask's kv_offset), the manager unmaps what lies wholly behind, and the tokens stay
transformers' own. Geometry: fp32, 2 KV heads x 16, 4 KiB pages = 32 tokens of one layer; a page
group is 2 * layers pages (FULL = 2 on a hybrid model, its one full layer)."""
from __future__ import annotations

import warnings

import pytest
import torch

from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf.cache import ContextOverflowError
from vmemkv.runtime.hf import VMemCache

from .test_window_models import prompts
from .window_families import WINDOW, build, gemma3n_kv_shared_config, hf_greedy

KiB = 1024
LAYERS = {"mistral": 2, "gemma2": 2, "gemma3": 6, "cohere2": 2}


def generate(label: str, prompt, new: int):
    model = build(label)
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=128,
                                        page_bytes=4 * KiB)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")      # past_key_values= is deprecated in 5.x
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                 past_key_values=cache)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist(), cache


@pytest.mark.parametrize("label", list(LAYERS))
def test_generate_gives_back_the_memory_behind_the_window_and_stays_exact(label):
    prompt, new = prompts(1, 20, 20, seed=7)[0], 100        # 120 tokens: 15 windows, 4 pages
    got, cache = generate(label, prompt, new)
    with cache:
        group = 2 * LAYERS[label]
        windowed = sum(w is not None for w in cache.config.layer_windows)
        assert all(layer.is_sliding == (w is not None)
                   for layer, w in zip(cache.layers, cache.config.layer_windows))
        # 119 tokens cached: the window (keys from 112 on) lies on page 3; full layers keep all 4
        held = 4 * 2 * (LAYERS[label] - windowed) + 1 * 2 * windowed
        assert cache.stats().mapped_pages == held < 4 * group      # full allocation: 4 groups
    assert got == hf_greedy(label, [prompt], new)[0]


def test_crop_into_the_given_back_memory_is_refused_and_changes_nothing():
    """The last query, at 78, read keys from 71 on: pages 0-1 (tokens [0, 64)) were given back,
    so a query at 71 (keys 64..71) is the earliest one left: crop at most 8 tokens."""
    _, cache = generate("mistral", prompts(1, 20, 20, seed=7)[0], 60)     # 79 tokens cached
    with cache:
        for count in (-40, -9):
            with pytest.raises(CacheStateError,
                               match=r"tokens \[0, 64\) was given back.*crop at most 8 tokens"):
                cache.crop(count)
            assert cache.get_seq_length() == 79
        cache.crop(-8)
        assert cache.get_seq_length() == 71


def test_a_windowed_layer_reports_the_mask_of_its_window():
    _, cache = generate("gemma2", prompts(1, 20, 20, seed=7)[0], 20)       # 39 cached
    with cache:
        windowed, full = cache.layers                        # gemma2: local, global
        assert windowed.get_mask_sizes(1) == (WINDOW, 39 - WINDOW + 1)
        assert full.get_mask_sizes(1) == (40, 0)
        cache.reorder_cache(torch.tensor([0]))               # only mapped tokens are touched


def test_reorder_after_a_crop_to_the_last_forwards_start_reads_only_mapped_memory():
    """crop may go back to where the last forward's queries began; a beam reorder then copies
    what a query there reads (mapped), not the token before it (given back: a segfault)."""
    model = build("mistral")
    seq = torch.tensor(prompts(1, 10, 10, seed=3) * 2)
    seq[1] = seq[1].flip(0)
    cache = VMemCache.from_model_config(model.config, max_batch=2, max_context=128,
                                        page_bytes=4 * KiB)
    with cache, torch.inference_mode():
        out = model(seq, cache=cache)
        for _ in range(30):                                   # 40 tokens: a page given back
            token = out.logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], 1)
            out = model(token, cache=cache)
        assert cache.stats().mapped_pages == 2 * 2 * 2        # page 1 of both rows' group
        cache.crop(-1)                                        # back to 39: the last forward's
        cache.reorder_cache(torch.tensor([1, 0]))
        got = model(seq[[1, 0], -1:], cache=cache).logits[:, -1]
        want = model(seq[[1, 0]]).logits[:, -1]
    torch.testing.assert_close(got, want)


def test_a_refused_update_gives_nothing_back():
    """The window's give-back and the growth are one transaction: an update refused for its
    length or batch leaves the memory, and how far crop may go, as they were."""
    model = build("mistral")
    cache = VMemCache.from_model_config(model.config, max_batch=2, max_context=71,
                                        page_bytes=4 * KiB)
    heads, dims = cache.config.num_kv_heads, cache.config.head_dim

    def update_all(batch: int, tokens: int) -> None:
        for layer in range(cache.config.num_layers):
            states = torch.randn(batch, heads, tokens, dims)
            cache.update(states, states, layer)

    with cache:
        update_all(1, 70)
        update_all(1, 1)                                      # 71 tokens: max_context
        before = cache.stats()
        for batch, tokens, error in ((1, 1, ContextOverflowError), (2, 1, CacheStateError)):
            with pytest.raises(error):
                update_all(batch, tokens)
            assert cache.stats() == before and cache.get_seq_length() == 71
        cache.crop(-1)                                        # as allowed as before
        assert cache.get_seq_length() == 70


def test_a_model_whose_shared_layers_never_write_crops_and_runs_prompt_lookup():
    """Gemma 3n's KV-shared layers read another layer's K/V and never call update: crop's bound
    counts only the layers that write, so prompt-lookup decoding runs as on transformers' cache."""
    from transformers import AutoModelForCausalLM
    config = gemma3n_kv_shared_config(eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.tensor([prompts(1, 6, 6, seed=2)[0] * 5])              # repeats to look up
    options = dict(max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=4)
    with VMemCache.from_model_config(model.config, max_batch=1, max_context=128) as cache, \
            torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model.generate(ids, cache=cache, **options)
        want = model.generate(ids, **options)
    assert got.tolist() == want.tolist()
