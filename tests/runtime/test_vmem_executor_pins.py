"""Pins of the vmem executor (runtime/cache/vmem_cache.py, vmem_ops.py, mapper.py): each test
names a promise of a docstring that a one-line slip would break without any other test noticing
(found by a mutation audit). Caches are built directly over the host driver and driven with
hand-written ops, so every page and byte is known; the mapper is held with Events (no sleeps)."""
from __future__ import annotations

import threading

import pytest
import torch

from vmemkv import vmem
from vmemkv.runtime.cache import VMemKVCache
from vmemkv.runtime.cache.mapper import BackgroundMapper
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError, PlanExecutionError
from vmemkv.runtime.kv import vmem_geometry
from vmemkv.scheduler.plan import (CopyExtent, LoadAdapter, MapExtent, ReleasePages, SetSlot,
                                   SwapIn, SwapOut, UnmapExtent)
from vmemkv.vmem.faults import FaultInjectingDriver
from tests.reliability.test_mapper_close_wait import HeldApply, release_when_the_waiter_blocks

CONFIG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=64)
LAYOUTS = ["per-layer", "interleaved"]


def vmem_cache(layout: str = "per-layer", **options) -> VMemKVCache:
    """4 KiB pages: per-layer 32 tokens a page, 4 pages a group (K, V of 2 layers); interleaved
    16 tokens a page, 2 pages a group; 2 slots of 64 tokens, 4 page groups."""
    return VMemKVCache(CONFIG, vmem_geometry(CONFIG, layout, 4096), num_groups=4, **options)


def map_group_at(slot: int, page_index: int, first_pool_page: int, n: int = 4) -> MapExtent:
    """Map a page group of ``n`` members (4 per-layer) from ``first_pool_page`` on."""
    return MapExtent(slot, page_index, "full", tuple(range(first_pool_page, first_pool_page + n)))


def map_group(cache: VMemKVCache, slot: int, page_index: int, first_pool_page: int) -> MapExtent:
    return map_group_at(slot, page_index, first_pool_page, cache.pages_per_group)


def numbered(cache: VMemKVCache, slot: int, tokens: int, start: float) -> list:
    """Fill tokens [0, tokens) of ``slot`` in every layer with distinct numbers; returns them."""
    filled = []
    for layer in range(CONFIG.num_layers):
        for i, cache_tensor in enumerate(cache.layer_tensors(layer)):
            rows = cache_tensor[slot, :tokens]
            rows.copy_(torch.arange(rows.numel(), dtype=torch.float32).reshape(rows.shape)
                       + start + 10_000 * (2 * layer + i))
            filled.append(rows.clone())
    return filled


def rows_of(cache: VMemKVCache, slot: int, tokens: int) -> list:
    return [t[slot, :tokens].clone() for layer in range(CONFIG.num_layers)
            for t in cache.layer_tensors(layer)]


def test_a_step_is_refused_when_the_widest_window_of_a_kind_reads_given_back_memory():
    """One kind of layers with windows 8 and 40 (32-token pages): with page 0 unmapped, a step
    at context 50 is refused, since the 40-token layer reads keys from token 10; at context
    73 (keys from 33) it runs."""
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2,
                         max_context=96, layer_windows=(8, 40))
    with VMemKVCache(config, vmem_geometry(config, "per-layer", 4096), num_groups=4) as cache:
        cache.execute([MapExtent(0, pi, "window-40", tuple(range(4 * pi, 4 * pi + 4)))
                       for pi in range(3)] + [UnmapExtent(0, 0, "window-40")])
        cache.apply_tables([SetSlot(0, 0)])
        with pytest.raises(CacheStateError, match="read keys from token 10 but the plans "
                                                  "mapped no memory for token 10"):
            cache.begin_step([(0, 49, 1)])
        step = cache.begin_step([(0, 72, 1)])
        assert step.lens.context_lens == (73,)


@pytest.mark.parametrize("mapper", [False, True])
def test_close_unmaps_a_resident_adapters_pages_and_gives_the_pool_back(mapper):
    """VMemKVCache.close with a LoRA adapter resident (a caller still holding its buffer): its
    range is closed with the KV range, so the pool closes and no address stays mapped (the
    caller's view keeps its bytes)."""
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    try:
        cache = vmem_cache(driver=driver, background_mapper=mapper)
        cache.execute([map_group(cache, 0, 0, 0), LoadAdapter("a" * 64, (9, 12), 5000)])
        weights = cache.adapter_buffer("a" * 64)      # a caller still holds the view
        weights.fill_(7)
        assert driver.mapped_addresses == cache.pages_per_group + 2
        cache.close()
        assert cache.pool.closed and driver.mapped_addresses == 0
        assert torch.equal(weights, torch.full((5000,), 7, dtype=torch.uint8))  # still readable
    finally:
        driver.close()


OVERWRITES = {"token copy": lambda tpp: CopyExtent(0, 0, 1, 0, "full", num_tokens=5),
              "page copy": lambda tpp: CopyExtent(0, 0, 1, 0, "full"),
              "swap-in": lambda tpp: SwapIn(5, tpp, slot=1)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", list(OVERWRITES))
def test_a_failed_plan_gives_an_overwritten_destination_its_bytes_back(layout, op):
    """All or nothing: a plan [an op overwriting slot 1's page, a map that fails] leaves slot
    1's bytes, slot 0's and the swap space as they were."""
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    try:
        with vmem_cache(layout, driver=driver) as cache:
            tpp, half = cache.tokens_per_page, cache.pool_pages // 2
            cache.execute([map_group(cache, 0, 0, 0), map_group(cache, 1, 0, half)])
            numbered(cache, 0, tpp, 0.5)
            cache.execute([SwapOut(5, tpp, slot=0)])
            src, dst = numbered(cache, 0, tpp, 200_000.5), numbered(cache, 1, tpp, 100_000.5)
            driver.fail_at("map", 0)
            with pytest.raises(PlanExecutionError, match="undone"):
                cache.execute([OVERWRITES[op](tpp), map_group(cache, 0, 1, cache.pages_per_group)])
            assert all(torch.equal(a, b) for a, b in zip(rows_of(cache, 1, tpp), dst))
            assert all(torch.equal(a, b) for a, b in zip(rows_of(cache, 0, tpp), src))
            assert cache.swapped_tokens() == {5: tpp}
            cache.check_integrity()
    finally:
        driver.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_unmapped_and_released_in_one_plan_lose_their_memory(layout):
    """ReleasePages applies after every layer's unmaps (the last op group)."""
    with vmem_cache(layout) as cache:
        cache.execute([map_group(cache, 0, 0, 0)])
        group = tuple(range(cache.pages_per_group))
        cache.execute([UnmapExtent(0, 0, "full"), ReleasePages(group)])
        assert [cache.pool.has_memory(cache._pool_pages[p]) for p in group] == [False] * len(group)
        assert cache.range.mapped_pages() == {}
        cache.check_integrity()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_failed_plan_recommits_released_pages_and_unloads_its_adapter(layout):
    """[release a page, load an adapter, a map failing at its last page]: undone whole."""
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    try:
        with vmem_cache(layout, driver=driver) as cache:
            last = cache.pool_pages - 1
            mappings = cache.range.mapped_pages()
            driver.fail_at("map", cache.pages_per_group - 1)   # in the last op group
            with pytest.raises(PlanExecutionError, match="undone"):
                cache.execute([ReleasePages((last,)), LoadAdapter("a" * 64, (last - 1,), 100),
                               map_group(cache, 0, 0, 0)])
            assert cache.pool.has_memory(cache._pool_pages[last])
            assert cache.resident_adapters() == {} and cache.range.mapped_pages() == mappings
            assert driver.mapped_addresses == 0
            cache.check_integrity()
    finally:
        driver.close()


# plan -> its refusal, on: slot 0 page 0 mapping pool pages 0..3, an adapter on 9, slot 1 empty
REFUSED = {
    "maps a page released earlier": ([ReleasePages((4,)), map_group_at(1, 0, 4)],
                                     "maps a pool page released earlier in the plan"),
    "copies a page and more": ([map_group_at(1, 0, 4),
                                CopyExtent(0, 0, 1, 0, "full", num_tokens=33)],
                               r"num_tokens must be in 1..32"),
    "copies tokens into nothing": ([CopyExtent(0, 0, 1, 0, "full", num_tokens=5)],
                                   r"the destination \(1 and 0 are\)"),
    "copies tokens onto themselves": ([CopyExtent(0, 0, 0, 0, "full", num_tokens=5)],
                                      "source and destination are one place"),
    "swaps out unmapped tokens": ([SwapOut(5, 40, slot=0)],
                                  "touches token 32 of slot 0, which has no 'full' memory"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_plan_the_replica_refuses_changes_nothing(case):
    ops, words = REFUSED[case]
    with vmem_cache() as cache:
        cache.execute([map_group(cache, 0, 0, 0), LoadAdapter("a" * 64, (9,), 100)])
        mappings, extents = cache.range.mapped_pages(), cache.mapped_extents(0)
        with pytest.raises(CacheStateError, match=words):
            cache.execute(ops)
        assert cache.range.mapped_pages() == mappings and cache.mapped_extents(0) == extents
        assert cache.resident_adapters() == {"a" * 64: ((9,), 100)}
        cache.check_integrity()


def test_a_plan_submitted_while_one_is_mapping_waits_for_it_whole():
    """BackgroundMapper.submit returns once the previous plan is fully applied: plans apply in
    order, every group of each."""
    apply = HeldApply()
    mapper = BackgroundMapper(apply, 3)
    try:
        mapper.submit("first")
        apply.in_group_0.wait()                    # the mapper thread holds group 0
        release_when_the_waiter_blocks(mapper, apply.go)
        second = threading.Thread(target=mapper.submit, args=("second",))
        second.start()
        second.join()                              # it blocked (releasing group 0) and submitted
        apply.go.set()
        mapper.wait_all()
    finally:
        apply.go.set()
        mapper.close()
    assert apply.applied == [(plan, g) for plan in ("first", "second") for g in range(3)]
