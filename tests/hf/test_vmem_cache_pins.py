"""VMemCache promises pinned by number, driven through ``update`` directly (random K/V, no model):
a forward after ``crop`` grows the rows only past what they held; ``reset()`` forgets how far
the last batch gave back its window; a beam reorder moves every key a later forward may read;
a beam index must name a row held; ``stats()`` counts every row and the memory created; a deep
copy crops, decodes and holds what the original does (8-bit scales kept fixed). Geometry:
CacheConfig of 2 layers, 2 KV heads x 16, fp32, 4 KiB pages = 32 tokens of one layer's K or V;
a row's page group is 2 x 2 pages."""
from __future__ import annotations

import copy

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf import VMemCache

PAGE_BYTES, TOKENS_PER_PAGE, LAYERS = 4096, 32, 2
GROUP_PAGES = 2 * LAYERS                      # a row's K and V pages of every layer


def make_cache(max_batch: int = 1, max_context: int = 128, **fields) -> VMemCache:
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         max_batch=max_batch, max_context=max_context, **fields)
    return VMemCache(config, page_bytes=PAGE_BYTES)


def forward(cache: VMemCache, batch: int, tokens: int, seed: int = 0) -> None:
    """One forward's writes: ``tokens`` new K/V per row, every layer in order."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k = torch.randn(batch, 2, tokens, 16, generator=g)
        cache.update(k, -k, layer)


def test_a_forward_after_a_crop_grows_only_past_what_the_rows_held():
    with make_cache() as cache:
        forward(cache, 1, 30)
        cache.crop(-10)                                     # 20 written, 30 held
        forward(cache, 1, 12)                               # to 32: 2 tokens past the 30 held
        assert cache.get_seq_length() == 32
        assert cache.stats().mapped_pages == GROUP_PAGES    # still within the first page
        assert cache.manager.num_tokens(cache._rows[0]) == 32
        forward(cache, 1, 1)                                # token 33 opens the second page
        assert cache.stats().mapped_pages == 2 * GROUP_PAGES


def test_reset_forgets_how_far_the_last_batch_gave_back_its_window():
    """A windowed cache's crop bound is where its own batch's memory was given back: after
    ``reset()`` a new batch that gave back nothing may crop as a fresh cache's may."""
    with make_cache(layer_windows=(16, 16)) as cache:
        forward(cache, 1, 40)
        for step in range(30):                              # decodes: memory behind 16 given back
            forward(cache, 1, 1, seed=step + 1)
        cache.reset()
        forward(cache, 1, 40)                               # a prefill: nothing given back
        cache.crop(-30)
        assert cache.get_seq_length() == 10


def test_a_beam_reorder_then_a_crop_back_to_the_last_forward_reads_the_reordered_keys():
    """``reorder_cache`` moves every key a later forward may read: after a crop back to where
    the last forward began (as far as crop may go), a windowed layer reads one key more than
    it did, and that key is the reordered row's too."""
    window = 16
    written = [[] for _ in range(LAYERS)]        # per layer, the keys written: (B, H, T, D)
    g = torch.Generator().manual_seed(5)

    def step(cache, tokens):
        for layer in range(LAYERS):
            k = torch.randn(2, 2, tokens, 16, generator=g)
            written[layer].append(k)
            keys, _ = cache.update(k, -k, layer)
        return keys

    with make_cache(max_batch=2, layer_windows=(window, window)) as cache:
        step(cache, 40)
        for _ in range(10):
            step(cache, 1)                          # 50 cached; the last forward began at 49
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.crop(-1)
        for layer in range(LAYERS):
            written[layer][-1] = written[layer][-1][:, :, :0]      # the cropped token
        keys = step(cache, 1)                       # a query at 49 reads keys 34..49
    everything = torch.cat(written[-1], dim=2)[[1, 0]]             # rows as reordered
    everything[:, :, -1] = written[-1][-1][:, :, 0]                 # the new token: not reordered
    assert keys.shape == (2, 2, window, 16)
    assert torch.equal(keys, everything[:, :, 50 - window:50])


def test_a_beam_index_equal_to_the_batch_is_refused_and_changes_nothing():
    with make_cache(max_batch=4) as cache:
        forward(cache, 2, 20)
        held = [t[:2, :20].clone() for t in cache.kv.layer_tensors(0)]   # mapped memory only
        with pytest.raises(CacheStateError, match=r"one row in \[0, 2\)"):
            cache.reorder_cache(torch.tensor([0, 2]))       # slot 2 exists; row 2 does not
        assert all(torch.equal(t[:2, :20], h) for t, h in zip(cache.kv.layer_tensors(0), held))


def test_stats_count_every_row_of_the_batch():
    bytes_per_token = LAYERS * 2 * 2 * 16 * 4           # K and V of every layer, fp32
    with make_cache(max_batch=4) as cache:
        forward(cache, 2, 20)
        s = cache.stats()
        assert (s.batch, s.seq_len) == (2, 20)
        assert s.live_bytes == 2 * 20 * bytes_per_token
        assert s.mapped_pages == 2 * GROUP_PAGES and s.mapped_bytes == s.mapped_pages * PAGE_BYTES
        assert s.reserved_bytes == s.budget_bytes == 4 * 128 * bytes_per_token
        assert s.mapped_bytes <= s.committed_bytes <= s.budget_bytes


def test_committed_bytes_keep_what_was_created_after_the_window_gives_pages_back():
    """``committed_bytes`` is the memory the pool created (kept until close), not what is
    mapped now: pages given back behind a window leave it as it was."""
    with make_cache(layer_windows=(16, 16)) as cache:
        forward(cache, 1, 40)
        peak_pages = cache.stats().mapped_pages              # two pages of 32 tokens a layer
        for step in range(40):
            forward(cache, 1, 1, seed=step + 1)
            peak_pages = max(peak_pages, cache.stats().mapped_pages)
        s = cache.stats()
        assert s.mapped_pages < peak_pages                   # 80 cached, keys from 65 on
        assert s.committed_bytes == cache.kv.pool.committed_bytes >= peak_pages * PAGE_BYTES


def test_a_deep_copy_of_a_windowed_cache_crops_only_as_far_as_the_original():
    """The copy holds the keys a query from the original's crop bound on reads, no more: a crop
    past that bound is refused on both (else the copy would read keys it never copied)."""
    with make_cache(layer_windows=(16, 16)) as cache:
        forward(cache, 1, 40)
        for step in range(40):
            forward(cache, 1, 1, seed=step + 1)              # 80 cached, last forward at 79
        with copy.deepcopy(cache) as twin:
            for held in (cache, twin):
                with pytest.raises(CacheStateError, match="crop at most 1 tokens"):
                    held.crop(-5)
                held.crop(-1)
                assert held.get_seq_length() == 79


def test_a_deep_copy_of_an_8bit_cache_keeps_the_scales_its_first_write_fixed():
    """The copy decodes what it copied with the original's scales and keeps them fixed: a
    later, larger write is encoded with them on both (clipped alike), not fixed anew."""
    with make_cache(kv_cache_dtype="int8") as cache:
        forward(cache, 1, 20)
        with copy.deepcopy(cache) as twin:
            big = 8 * torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(9))
            keys = [[held.update(big, big, layer)[0] for layer in range(LAYERS)]
                    for held in (cache, twin)]
            assert all(torch.equal(mine, its) for mine, its in zip(*keys))


def test_a_deep_copy_after_a_long_chunk_holds_what_a_query_at_its_start_reads():
    """A windowed cache whose last forward was a long chunk gave back only what lies behind
    that chunk's first query: the copy holds the same pages and reads the same keys."""
    with make_cache(layer_windows=(16, 16)) as cache:
        forward(cache, 1, 40)
        for step in range(10):
            forward(cache, 1, 1, seed=step + 1)
        forward(cache, 1, 60, seed=11)                        # tokens 50..109, one forward
        with copy.deepcopy(cache) as twin:
            assert twin.stats().mapped_pages == cache.stats().mapped_pages
            twin.crop(-60)                                    # back to the chunk's start
            cache.crop(-60)
            k = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(12))
            for layer in range(LAYERS):
                assert torch.equal(twin.update(k, k, layer)[0], cache.update(k, k, layer)[0])
