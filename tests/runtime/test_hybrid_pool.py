"""The hybrid pool executor on hand-written extent-op plans (host driver): every MapExtent names
the pool pages backing one layer kind's members at a (slot, page index); two spots naming the
same pages share their bytes; unmapping the window kind keeps the full kind's tokens readable
and its pool pages can be named again by another spot; refused ops change nothing; reads and
steps that would touch an unmapped windowed member are refused, never performed. Layout: see
hybrid_pool."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.cache import VMemKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError, CacheStateError
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.plan import CopyExtent, MapExtent, SwapOut, UnmapExtent

from .hybrid_pool import (FULL, FULL_PAGES, KINDS, KiB, TPP, WINDOW, WINDOW_PAGES, hybrid_cache,
                          hybrid_config, kv_of, same, snapshot, write)

GROUP_PAGES = FULL_PAGES + WINDOW_PAGES


def group(slot: int, page_index: int, first: int) -> list:
    """Both kinds' extents at (slot, page_index) on pool pages first..first+5."""
    return [MapExtent(slot, page_index, FULL, tuple(range(first, first + FULL_PAGES))),
            MapExtent(slot, page_index, WINDOW,
                      tuple(range(first + FULL_PAGES, first + GROUP_PAGES)))]


def pool_ids(cache, slot: int, page_index: int, layers) -> set:
    """Pool page ids the range maps for ``layers``' K and V at (slot, page_index)."""
    c, mapped = cache.config, cache.range.mapped_pages()
    spots = [((2 * l + kv) * c.max_batch + slot) * cache.pages_per_slot + page_index
             for l in layers for kv in (0, 1)]
    return {mapped[s] for s in spots if s in mapped}


def test_two_spots_naming_the_same_pool_pages_share_them_and_their_bytes():
    with hybrid_cache() as cache:
        cache.execute(group(0, 0, 0))
        assert cache.mapped_pool_pages == GROUP_PAGES
        cache.execute(group(1, 2, 0))                          # the same pages, another spot
        assert cache.mapped_pool_pages == GROUP_PAGES          # counted once
        assert cache.mapped_extents(1) == {2: {FULL: (0, 1), WINDOW: (2, 3, 4, 5)}}
        assert pool_ids(cache, 0, 0, range(3)) == pool_ids(cache, 1, 2, range(3))
        assert len(pool_ids(cache, 0, 0, range(3))) == GROUP_PAGES
        write(cache, 5, 0, 0, 20)
        k, _ = kv_of(5, 1, range(20))
        view = cache.layer_tensors(1)[0]
        assert torch.equal(view[1, 2 * TPP:2 * TPP + 20], k)   # slot 1 sees slot 0's bytes
        cache.check_integrity()


def test_unmapping_the_window_kind_keeps_the_full_tokens_and_its_pages_serve_another_spot():
    with hybrid_cache(pool_pages=2 * GROUP_PAGES) as cache:
        cache.execute(group(0, 0, 0) + group(0, 1, GROUP_PAGES))
        write(cache, 7, 0, 0, 40)
        window_pages = pool_ids(cache, 0, 0, (0, 2))
        cache.execute([UnmapExtent(0, 0, WINDOW)])
        assert cache.mapped_pool_pages == 2 * GROUP_PAGES - WINDOW_PAGES
        assert cache.mapped_extents(0)[0] == {FULL: (0, 1)}
        cache.execute([MapExtent(1, 0, WINDOW, (2, 3, 4, 5))])  # the given-back pages, reused
        assert pool_ids(cache, 1, 0, (0, 2)) == window_pages
        assert cache.mapped_pool_pages == 2 * GROUP_PAGES
        k, v = cache.read(7, 1, 40)                            # the full layer keeps tokens 0..39
        assert torch.equal(k, kv_of(7, 1, range(40))[0]) and torch.equal(v, kv_of(7, 1, range(40))[1])
        with pytest.raises(CacheStateError, match="layer 0"):
            cache.read(7, 0, 40)                               # its windowed members are gone
        cache.check_integrity()


def test_a_step_reads_the_window_kind_only_from_the_window_start():
    with hybrid_cache() as cache:
        cache.execute(group(0, 0, 0) + group(0, 1, GROUP_PAGES))
        write(cache, 7, 0, 0, 40)
        cache.execute([UnmapExtent(0, 0, WINDOW)])
        cache.begin_step([(7, 40, 1)])      # window 8: keys from 33 on, all on page 1
        for layer in range(3):
            cache.write(layer, *kv_of(7, layer, range(40, 41)))
        with pytest.raises(CacheStateError, match="'window-8' layers read keys from token 25"):
            cache.begin_step([(7, 32, 9)])   # a query at 32 reads key 25 of the windowed layers
        with pytest.raises(CacheStateError, match="writing tokens up to 41 but the plans mapped "
                                                  "no memory of its 'window-8' layers for token 30"):
            cache.begin_step([(7, 30, 11)])  # and writes 30, 31 there


def refused(cache, plan, match: str) -> None:
    before = snapshot(cache)
    with pytest.raises(CacheStateError, match=match):
        cache.execute(plan)
    assert same(snapshot(cache), before)
    cache.check_integrity()


def test_refused_extent_ops_change_nothing():
    with hybrid_cache(pool_pages=GROUP_PAGES + FULL_PAGES) as cache:
        cache.execute(group(0, 0, 0))
        write(cache, 1, 0, 0, 10)
        refused(cache, [UnmapExtent(0, 0, WINDOW), UnmapExtent(0, 0, WINDOW)], "at op 1.*an unmap of nothing")
        refused(cache, [MapExtent(1, 0, FULL, (6, 7)), MapExtent(1, 1, FULL, (6, 8))],
                "at op 1.*pool page outside 0..7")
        refused(cache, [MapExtent(1, 0, FULL, (6, 7)), MapExtent(0, 0, WINDOW, (2, 3, 4, 5))],
                "at op 1.*mapped twice at one place")
        refused(cache, [MapExtent(0, 1, FULL, (6, 7)), UnmapExtent(0, 1, WINDOW)], "an unmap of nothing")
        refused(cache, [MapExtent(0, 1, WINDOW, (6, 7))], r"a page per member \(4\)")
        refused(cache, [MapExtent(0, 1, "window-9", (6, 7))], "names kind 'window-9'")
        refused(cache, [UnmapExtent(0, 0, WINDOW), SwapOut(1, 10, slot=0)],
                "at op 1.*no .window-8. memory mapped")
        refused(cache, [MapExtent(1, 0, FULL, (6, 7)), CopyExtent(0, 0, 1, 0, WINDOW)],
                "at op 1.*destination mapped at least as far")
        assert cache.swapped_tokens() == {}


def test_a_cache_of_one_kind_refuses_ops_naming_a_window_kind():
    config = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16, max_batch=2, max_context=128)
    with VMemKVCache(config, PageGeometry.of(config, 4 * KiB, "per-layer"), 4) as cache:
        assert cache.kinds == ((FULL, (0, 1, 2)),) and cache.pool_pages == 4 * 6
        for op in (MapExtent(0, 0, WINDOW, (0, 1, 2, 3)), UnmapExtent(0, 0, WINDOW)):
            with pytest.raises(CacheStateError, match="names kind 'window-8'"):
                cache.execute([op])
        assert cache.mapped_pool_pages == 0


@pytest.mark.parametrize("kinds,layout", [
    (KINDS, "interleaved"),                                   # interleaved: one kind only
    (((FULL, (1,)), (WINDOW, (0,))), "per-layer"),            # layer 2 in no kind
    (((FULL, (0, 1)), (WINDOW, (0, 2))), "per-layer"),        # layer 0 twice
])
def test_the_layer_kinds_must_cover_every_layer_once(kinds, layout):
    config = hybrid_config()
    page_bytes = 12 * KiB if layout == "interleaved" else 4 * KiB
    with pytest.raises(CacheConfigError, match="layer kinds must cover each of the 3 layers once"):
        VMemKVCache(config, PageGeometry.of(config, page_bytes, layout), 4, pool_pages=12,
                    kinds=kinds)


@pytest.mark.parametrize("pool_pages", [0, -1, True, 2.5])
def test_pool_pages_must_be_a_positive_int(pool_pages):
    config = hybrid_config()
    with pytest.raises(CacheConfigError, match="pool_pages must be None or an int >= 1"):
        VMemKVCache(config, PageGeometry.of(config, 4 * KiB, "per-layer"), 4, pool_pages=pool_pages)


def test_two_replicas_given_the_same_plans_map_the_same_pages():
    plans = [group(0, 0, 0) + [MapExtent(1, 0, FULL, (6, 7))], [UnmapExtent(0, 0, WINDOW)],
             [MapExtent(1, 0, WINDOW, (2, 3, 4, 5))], group(0, 1, 8)]
    a, b = hybrid_cache(), hybrid_cache()
    with a, b:
        for plan in plans:
            a.execute(plan)
            b.execute(plan)
            assert a.range.mapped_pages() == b.range.mapped_pages()
            assert [a.mapped_extents(s) for s in (0, 1)] == [b.mapped_extents(s) for s in (0, 1)]
        assert a.mapped_pool_pages == 14
