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
from vmemkv.runtime.hf import VMemCache

from .test_window_models import prompts
from .window_families import WINDOW, build, hf_greedy

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
    _, cache = generate("mistral", prompts(1, 20, 20, seed=7)[0], 60)     # 79 tokens cached
    with cache:
        with pytest.raises(CacheStateError, match="given back; crop at most 1 tokens"):
            cache.crop(-40)
        assert cache.get_seq_length() == 79
        cache.crop(-1)
        assert cache.get_seq_length() == 78


def test_a_windowed_layer_reports_the_mask_of_its_window():
    _, cache = generate("gemma2", prompts(1, 20, 20, seed=7)[0], 20)       # 39 cached
    with cache:
        windowed, full = cache.layers                        # gemma2: local, global
        assert windowed.get_mask_sizes(1) == (WINDOW, 39 - WINDOW + 1)
        assert full.get_mask_sizes(1) == (40, 0)
        cache.reorder_cache(torch.tensor([0]))               # only mapped tokens are touched
