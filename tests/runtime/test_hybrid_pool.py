"""The hybrid pool executor on hand-written part-op plans (host driver): pool pages are bound
to a page group's part at its first MapGroup, shared by every spot that maps it, given back at
ReleaseGroup and reused by the next group; refused ops change nothing; reads and steps that
would touch an unmapped windowed member are refused, never performed. Layout: see hybrid_pool."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.cache import VMemKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError, CacheStateError
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.plan import CopyGroup, GroupPart, MapGroup, ReleaseGroup, SwapOut, UnmapGroup

from .hybrid_pool import (FULL_PAGES, KiB, TPP, WINDOW_PAGES, hybrid_cache, hybrid_config, kv_of,
                          same, snapshot, write)

FULL, WINDOW, ALL = GroupPart.FULL, GroupPart.WINDOW, GroupPart.ALL
GROUP_PAGES = FULL_PAGES + WINDOW_PAGES


def pool_ids(cache, slot: int, page_index: int, layers) -> set:
    """Pool page ids the range maps for ``layers``' K and V at (slot, page_index)."""
    c, mapped = cache.config, cache.range.mapped_pages()
    spots = [((2 * l + kv) * c.max_batch + slot) * cache.pages_per_slot + page_index
             for l in layers for kv in (0, 1)]
    return {mapped[s] for s in spots if s in mapped}


def test_first_map_binds_a_groups_pages_and_a_second_spot_shares_them():
    with hybrid_cache() as cache:
        cache.execute([MapGroup(0, 0, 3)])
        assert cache.bound_pages == GROUP_PAGES
        cache.execute([MapGroup(1, 2, 3)])                     # the same group, another spot
        assert cache.bound_pages == GROUP_PAGES                # nothing more bound
        assert pool_ids(cache, 0, 0, range(3)) == pool_ids(cache, 1, 2, range(3))
        assert len(pool_ids(cache, 0, 0, range(3))) == GROUP_PAGES
        write(cache, 5, 0, 0, 20)
        k, _ = kv_of(5, 1, range(20))
        view = cache.layer_tensors(1)[0]
        assert torch.equal(view[1, 2 * TPP:2 * TPP + 20], k)   # slot 1 sees slot 0's bytes
        cache.check_integrity()


def test_partial_unmap_keeps_the_full_part_and_release_gives_the_window_pages_to_the_next_group():
    with hybrid_cache(pool_pages=2 * GROUP_PAGES) as cache:
        cache.execute([MapGroup(0, 0, 0), MapGroup(0, 1, 1)])
        write(cache, 7, 0, 0, 40)
        window_pages = pool_ids(cache, 0, 0, (0, 2))
        cache.execute([UnmapGroup(0, 0, 0, WINDOW)])
        assert cache.bound_pages == 2 * GROUP_PAGES            # unmapped, still bound
        assert cache.mapped_parts(0)[0] == {FULL: 0}
        with pytest.raises(CacheStateError, match="pool pages"):
            cache.execute([MapGroup(1, 0, 2)])                 # the pool is full until released
        cache.execute([ReleaseGroup(0, WINDOW)])
        assert cache.bound_pages == 2 * GROUP_PAGES - WINDOW_PAGES
        cache.execute([MapGroup(1, 0, 2, WINDOW)])             # the released pages, reused
        assert pool_ids(cache, 1, 0, (0, 2)) == window_pages
        k, v = cache.read(7, 1, 40)                            # the full layer keeps tokens 0..39
        assert torch.equal(k, kv_of(7, 1, range(40))[0]) and torch.equal(v, kv_of(7, 1, range(40))[1])
        with pytest.raises(CacheStateError, match="layer 0"):
            cache.read(7, 0, 40)                               # its windowed members are gone
        cache.check_integrity()


def test_a_step_reads_the_window_part_only_from_the_window_start():
    with hybrid_cache() as cache:
        cache.execute([MapGroup(0, 0, 0), MapGroup(0, 1, 1)])
        write(cache, 7, 0, 0, 40)
        cache.execute([UnmapGroup(0, 0, 0, WINDOW), ReleaseGroup(0, WINDOW)])
        cache.begin_step([(7, 40, 1)])      # window 8: keys from 33 on, all on page 1
        for layer in range(3):
            cache.write(layer, *kv_of(7, layer, range(40, 41)))
        with pytest.raises(CacheStateError, match="'window' layers' tokens 0..31"):
            cache.begin_step([(7, 30, 11)])  # a query at 30 reads key 23 of the windowed layers


def refused(cache, plan, match: str) -> None:
    before = snapshot(cache)
    with pytest.raises(CacheStateError, match=match):
        cache.execute(plan)
    assert same(snapshot(cache), before)
    cache.check_integrity()


def test_refused_part_ops_change_nothing():
    with hybrid_cache(pool_pages=GROUP_PAGES + FULL_PAGES) as cache:
        cache.execute([MapGroup(0, 0, 0)])
        write(cache, 1, 0, 0, 10)
        refused(cache, [UnmapGroup(0, 0, 0, WINDOW), ReleaseGroup(0, ALL)], "at op 1, .* still mapped")
        refused(cache, [MapGroup(1, 0, 1, FULL), MapGroup(1, 1, 2, FULL)], "needs 2 free pool pages")
        refused(cache, [MapGroup(1, 0, 1, FULL), MapGroup(0, 0, 0, WINDOW)], "already mapped")
        refused(cache, [MapGroup(0, 1, 1, FULL), UnmapGroup(0, 1, 1, WINDOW)], "not mapped there")
        refused(cache, [UnmapGroup(0, 0, 0), ReleaseGroup(1, FULL)], "no pages are bound")
        refused(cache, [MapGroup(0, 1, 8)], "outside 0..7")
        refused(cache, [MapGroup(0, 1, 1, "half")], "unknown group part 'half'")
        refused(cache, [UnmapGroup(0, 0, 0, WINDOW), SwapOut(1, 10, slot=0)], "'window' part is not mapped")
        refused(cache, [MapGroup(1, 0, 1, FULL), CopyGroup(1, 0, 0, 0)], "both need the destination's")
        assert cache.swapped_tokens() == {}


def test_a_cache_of_fixed_groups_refuses_part_ops():
    config = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16, max_batch=2, max_context=128)
    with VMemKVCache(config, PageGeometry.of(config, 4 * KiB, "per-layer"), 4) as cache:
        for op in (MapGroup(0, 0, 0, WINDOW), UnmapGroup(0, 0, 0, FULL), ReleaseGroup(0)):
            with pytest.raises(CacheStateError, match="part-op for a hybrid pool"):
                cache.execute([op])
        assert cache.pool_pages is None and cache.bound_pages == 4 * 6


@pytest.mark.parametrize("windows,layout,match", [
    ((8, None, 8), "interleaved", "per-layer layout, got layout interleaved"),
    ((), "per-layer", r"both full and windowed layers; its layer_windows are \(\)"),
    ((8, 8, 8), "per-layer", r"layer_windows are \(8, 8, 8\)"),
])
def test_a_hybrid_pool_needs_the_per_layer_layout_and_a_hybrid_model(windows, layout, match):
    config = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16, max_batch=2, max_context=128,
                         layer_windows=windows)
    # pages holding whole tokens (on 4 KiB, 3 interleaved layers' 384-byte tokens straddle
    # pages and pool_pages is a byte-mapped pool instead, vmem_slices)
    page_bytes = 12 * KiB if layout == "interleaved" else 4 * KiB
    with pytest.raises(CacheConfigError, match=match):
        VMemKVCache(config, PageGeometry.of(config, page_bytes, layout), 4, pool_pages=12)


def test_a_hybrid_pool_needs_a_geometry_split_at_the_configs_windowed_layers():
    config = hybrid_config()
    unsplit = PageGeometry("per-layer", 4 * KiB, 3, config.layer_bytes_per_token)
    with pytest.raises(CacheConfigError, match=r"splits groups at windowed layers \(\), the "
                                               r"CacheConfig's windowed layers are \(0, 2\)"):
        VMemKVCache(config, unsplit, 4, pool_pages=12)


@pytest.mark.parametrize("pool_pages", [0, -1, True, 2.5])
def test_pool_pages_must_be_a_positive_int(pool_pages):
    config = hybrid_config()
    with pytest.raises(CacheConfigError, match="pool_pages must be None or an int >= 1"):
        VMemKVCache(config, PageGeometry.of(config, 4 * KiB, "per-layer"), 4, pool_pages=pool_pages)


def test_two_replicas_given_the_same_plans_bind_the_same_pages():
    plans = [[MapGroup(0, 0, 5), MapGroup(1, 0, 2, FULL)], [UnmapGroup(0, 0, 5, WINDOW)],
             [ReleaseGroup(5, WINDOW), MapGroup(1, 0, 2, WINDOW)], [MapGroup(0, 1, 6)]]
    a, b = hybrid_cache(), hybrid_cache()
    with a, b:
        for plan in plans:
            a.execute(plan)
            b.execute(plan)
            assert a.range.mapped_pages() == b.range.mapped_pages()
