"""Which layer ends a forward, as the VMemCache's guard learns it (runtime/hf/cache_guard.py),
pinned with ``update`` calls from two threads, never overlapping in time: a cache handed to
another thread once a forward wrote its top layer keeps working; one handed over mid-forward is
refused. The top layer is, built from a model config, the last below Gemma 3n's KV-shared
layers; without one, the last layer until the same thread starts over at or below the layer it
stopped at, then that layer, until ``reset()``."""
from __future__ import annotations

import threading

import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf import VMemCache

from .window_families import gemma3n_kv_shared_config


def write(cache: VMemCache, layer: int, tokens: int = 1) -> None:
    k = torch.ones(1, cache.config.num_kv_heads, tokens, cache.config.head_dim)
    cache.update(k, k, layer)


def in_another_thread(cache: VMemCache, layer: int):
    """The error (or None) of writing ``layer`` from a second thread."""
    outcome = {}

    def run():
        try:
            write(cache, layer)
            outcome["error"] = None
        except CacheStateError as error:
            outcome["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return outcome["error"]


def plain_cache(num_layers: int) -> VMemCache:
    return VMemCache(CacheConfig(num_layers=num_layers, num_kv_heads=2, head_dim=16,
                                 max_batch=1, max_context=64))


def test_a_model_whose_kv_shared_layers_never_write_hands_its_cache_over_after_its_forward():
    config = gemma3n_kv_shared_config()
    with VMemCache.from_model_config(config, max_batch=1, max_context=64) as cache:
        write(cache, 0, 5)
        write(cache, 1, 5)                          # layers 2 and 3 read these: forward done
        assert in_another_thread(cache, 0) is None


def test_without_a_model_config_a_forward_that_starts_over_at_its_last_layer_ends_there():
    with plain_cache(2) as cache:                    # a model that writes layer 0 only
        write(cache, 0, 5)
        write(cache, 0)                              # the next forward: layer 0 is the top
        assert in_another_thread(cache, 0) is None


def test_reset_forgets_the_learnt_top_layer():
    with plain_cache(2) as cache:
        write(cache, 0, 5)
        write(cache, 0)                              # top learnt: layer 0
        cache.reset()
        write(cache, 0, 5)                           # a forward of both layers, at layer 0
        error = in_another_thread(cache, 0)
        assert isinstance(error, CacheStateError) and "another thread" in str(error)
