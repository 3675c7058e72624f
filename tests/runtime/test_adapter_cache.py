"""LoRA adapter memory in the caches (issue 31): LoadAdapter / EvictAdapter executed on real
memory (the host driver), ``adapter_buffer`` backed by exactly the pool pages the op named,
those pages back in the KV range after an eviction, every refusal by name with nothing changed,
a failing plan undone whole, the static split's pages, and a scheduler's plans with adapters
executed step by step with the cache equal to the manager (``check_matches``)."""
from __future__ import annotations

import hashlib
import pickle
import random

import pytest
import torch

from vmemkv import vmem
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError, PlanExecutionError
from vmemkv.runtime.kv import cache_from_layout, check_matches, make_kv
from vmemkv.scheduler.adapters import AdapterRef
from vmemkv.scheduler.plan import (CopyBlock, EvictAdapter, LoadAdapter, MapExtent,
                                   ReleasePages, SchedulerConfig, SwapIn)
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler
from vmemkv.vmem.faults import FaultInjectingDriver

KiB = 1024
CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=64)
VMEM = {"per-layer": dict(layout="per-layer", page_bytes=4 * KiB),
        "interleaved": dict(layout="interleaved", page_bytes=4 * KiB)}


def ref(key: str, num_bytes: int, name: str = "lora") -> AdapterRef:
    return AdapterRef(name, hashlib.sha256(key.encode()).hexdigest(), num_bytes)


def pattern(adapter: AdapterRef) -> torch.Tensor:
    seed = int(adapter.digest[:8], 16)
    return torch.arange(adapter.num_bytes, dtype=torch.int64).add(seed).remainder(251) \
        .to(torch.uint8)


def kv_for(kind: str, driver=None, **options):
    config = CacheConfig(**CONFIG)
    if kind == "paged":
        return make_kv(config, "paged", cache_bytes=64 * KiB, block_size=8, **options)
    return make_kv(config, "vmem", cache_bytes=64 * KiB, driver=driver,
                   **dict(VMEM[kind], **options))


def page_bytes_of(cache, pool_page: int) -> torch.Tensor:
    """The bytes of one pool page, read through a range of its own (not the adapter's)."""
    rng = vmem.VirtualRange(cache.pool, cache.page_bytes)
    try:
        rng.map(0, cache._pool_pages[pool_page])
        return rng.tensor(0, cache.page_bytes).clone()
    finally:
        rng.close()


@pytest.mark.parametrize("kind", list(VMEM))
@pytest.mark.parametrize("mapper", [False, True])
def test_an_adapter_lives_in_the_pool_pages_its_load_named(kind, mapper):
    kv = kv_for(kind, background_mapper=mapper)
    m, cache = kv.manager, kv.cache
    adapter = ref("a", 3 * cache.page_bytes + 100)
    m.acquire_adapter(adapter)
    ops = m.take_ops()
    load = ops[-1]
    assert type(load) is LoadAdapter and len(load.pool_pages) == 4
    kv.execute(ops)
    buffer = cache.adapter_buffer(adapter.digest)
    assert buffer.dtype == torch.uint8 and buffer.shape == (adapter.num_bytes,)
    buffer.copy_(pattern(adapter))
    # zero-copy: every named pool page holds its slice of the bytes, in order
    for i, page in enumerate(load.pool_pages):
        want = pattern(adapter)[i * cache.page_bytes:(i + 1) * cache.page_bytes]
        assert torch.equal(page_bytes_of(cache, page)[:len(want)], want), (i, page)
    assert torch.equal(cache.adapter_buffer(adapter.digest), pattern(adapter))
    check_matches(m, cache)
    # released and pushed out by KV: its pages are mapped in the KV range
    m.release_adapter(adapter)
    total = m.stats().total_tokens
    m.allocate(0, 64)
    m.allocate(1, total - 64)
    ops = m.take_ops()
    assert [op.adapter_id for op in ops if type(op) is EvictAdapter] == [adapter.digest]
    kv.execute(ops)
    kv.sync_tables([0, 1])
    check_matches(m, cache)
    assert cache.resident_adapters() == {}
    with pytest.raises(CacheStateError, match="not resident"):
        cache.adapter_buffer(adapter.digest)
    mapped = set(cache.range.mapped_pages().values())
    assert {cache._pool_pages[p] for p in load.pool_pages} <= mapped
    kv.close()


@pytest.mark.parametrize("kind", ["per-layer", "interleaved", "paged"])
def test_a_refused_adapter_op_changes_nothing(kind):
    kv = kv_for(kind)
    m, cache = kv.manager, kv.cache
    adapter = ref("a", 2 * 4 * KiB)
    m.acquire_adapter(adapter)
    load = m.take_ops()[-1]
    kv.execute([load])
    before = cache.resident_adapters()
    m.allocate(0, 8)
    kv.execute(m.take_ops())
    kv.sync_tables([0])
    unit = cache._adapter_unit_bytes
    free_units = [u for u in range(cache._adapter_units)
                  if u not in load.pool_pages and u not in mapped_units(cache)]
    if kind == "paged":       # (the blocks a table names are the manager's business)
        free_units = [u for u in free_units if u not in m.block_table(0)]
    valid = LoadAdapter("v" * 64, (free_units[-1],), 10)      # undone with the refused op
    bad = [
        (LoadAdapter(adapter.digest, load.pool_pages, adapter.num_bytes), "resident already"),
        (LoadAdapter("x" * 64, tuple(free_units[:1]), 2 * unit), "take 2 units"),
        (LoadAdapter("x" * 64, load.pool_pages[:1], 10), "units in use"),
        (LoadAdapter("x" * 64, (free_units[-1],), 10), "units in use"),
        (LoadAdapter("x" * 64, (10**6,), 10), "distinct units"),
        (LoadAdapter("x" * 64, (free_units[0],), 0), "num_bytes"),
        (EvictAdapter("y" * 64, (0,)), "not resident"),
        (EvictAdapter(adapter.digest, load.pool_pages[::-1]), "not resident as named"),
        (SwapIn(7, 4, slot=1, blocks=(free_units[0],)), "sequence 7 has no swapped-out data"),
    ]
    if kind != "paged":
        kind_name = cache.kinds[0][0]
        members = len(cache._kinds[kind_name].members)
        bad += [(LoadAdapter("x" * 64, (next(iter(mapped_units(cache))),), 10), "units in use"),
                (MapExtent(1, 0, kind_name, load.pool_pages[:1] * members), "adapter holds"),
                (ReleasePages(load.pool_pages[:1]), "still mapped")]
    for op, words in bad:
        with pytest.raises(CacheStateError, match=words):
            cache.execute([valid, op])
        assert cache.resident_adapters() == before, op
        check_matches(m, cache)
    kv.close()


def mapped_units(cache) -> set:
    if cache.kind == "paged":
        return set()
    return cache._kv_mapped()


@pytest.mark.parametrize("kind", list(VMEM))
def test_a_plan_failing_after_a_load_is_undone_whole(kind):
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    kv = kv_for(kind, driver=driver)
    m, cache = kv.manager, kv.cache
    old = ref("old", 4 * KiB)
    m.acquire_adapter(old)
    kv.execute(m.take_ops())
    cache.adapter_buffer(old.digest).copy_(pattern(old))
    m.release_adapter(old)
    m.begin()
    m.evict_idle_adapter()
    new = ref("new", 2 * 4 * KiB + 1)
    m.acquire_adapter(new)
    ops = m.take_ops()
    assert [type(op) for op in ops] == [EvictAdapter, LoadAdapter]
    mappings = cache.range.mapped_pages()
    driver.fail_at("map", 2)            # the new adapter's third page
    with pytest.raises(PlanExecutionError, match="undone"):
        cache.execute(ops)
    m.rollback()
    assert cache.resident_adapters() == m.resident_adapters()
    assert torch.equal(cache.adapter_buffer(old.digest), pattern(old)), "the old one is back"
    assert cache.range.mapped_pages() == mappings
    check_matches(m, cache)
    kv.close()


@pytest.mark.parametrize("kind", list(VMEM))
def test_a_load_failing_part_way_unmaps_the_pages_its_own_range_mapped(kind):
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    kv = kv_for(kind, driver=driver)
    m, cache = kv.manager, kv.cache
    m.acquire_adapter(ref("a", 2 * 4 * KiB + 1))      # three pages
    ops = m.take_ops()
    mapped = driver.mapped_addresses
    driver.fail_at("map", 2)            # its third page: two are mapped in its range
    with pytest.raises(PlanExecutionError, match="undone") as info:
        cache.execute(ops)
    assert driver.mapped_addresses == mapped, info.value   # (info keeps the failed call's frames)
    assert cache.resident_adapters() == {}
    kv.close()


def test_paged_adapters_take_blocks_and_a_buffer_of_their_own():
    kv = kv_for("paged")
    m, cache = kv.manager, kv.cache
    adapter = ref("a", 3 * m.block_bytes + 7)
    m.acquire_adapter(adapter)
    ops = m.take_ops()
    assert len(ops[-1].pool_pages) == 4
    kv.execute(ops)
    buffer = cache.adapter_buffer(adapter.digest)
    assert buffer.device == cache.pools.device and buffer.shape == (adapter.num_bytes,)
    buffer.copy_(pattern(adapter))
    check_matches(m, cache)
    # a plan that fails after its load leaves nothing behind
    m.release_adapter(adapter)
    m.begin()
    m.evict_idle_adapter()
    other = ref("b", 10)
    m.acquire_adapter(other)
    ops = m.take_ops()
    with pytest.raises(PlanExecutionError):
        cache.execute(ops + [CopyBlock(10**6, 0)])
    m.rollback()
    assert torch.equal(cache.adapter_buffer(adapter.digest), pattern(adapter))
    check_matches(m, cache)
    kv.close()


@pytest.mark.parametrize("kind", ["per-layer", "interleaved", "paged"])
def test_a_static_split_names_adapter_units_after_the_pools_and_replays(kind):
    kv = kv_for(kind, adapter_budget_bytes=16 * KiB)
    m, cache = kv.manager, kv.cache
    layout = pickle.loads(pickle.dumps(m.layout()))
    assert layout.adapter_pool_pages == 16 * KiB // (4 * KiB if kind != "paged" else m.block_bytes)
    adapter = ref("a", 12 * KiB)
    m.acquire_adapter(adapter)
    ops = m.take_ops()
    first = m.pool_pages if kind != "paged" else m.num_blocks
    assert min(ops[-1].pool_pages) >= first
    kv.execute(ops)
    cache.adapter_buffer(adapter.digest).copy_(pattern(adapter))
    total = m.stats().total_tokens
    m.allocate(0, 64)
    m.allocate(1, total - 64)                  # all of KV's part, beside the adapter
    assert m.adapter_stats().resident == 1
    kv.execute(m.take_ops())
    kv.sync_tables([0, 1])
    check_matches(m, cache)
    # a cache built from the layout alone executes the same ops
    replay = cache_from_layout(layout, cache.config)
    replay.execute(ops)
    assert replay.resident_adapters() == cache.resident_adapters()
    replay.close()
    kv.close()


@pytest.mark.parametrize("kind", ["per-layer", "interleaved", "paged"])
def test_a_schedulers_plans_with_adapters_run_on_the_cache(kind):
    """Requests with three adapters through a tight cache: each step's plan executed, each
    loaded adapter's bytes written after the plan; they read back intact every step while
    resident, and the cache equals the manager."""
    kv = kv_for(kind, swap_bytes=32 * KiB)
    m, cache = kv.manager, kv.cache
    sched = Scheduler(m, SchedulerConfig(check_every_step=True, preemption="swap",
                                         enable_prefix_sharing=True), tables=kv.tables)
    adapters = [ref("a", 5 * KiB), ref("b", 9 * KiB), ref("c", 13 * KiB, name="a"), None]
    rng = random.Random(3)
    for i in range(14):
        prompt = tuple(rng.randrange(1, 5) for _ in range(rng.randrange(3, 24)))
        sched.add_request(Request(i, len(prompt), rng.randrange(2, 30), prompt_token_ids=prompt,
                                  adapter=adapters[i % len(adapters)], n=1 + (i % 5 == 0)))
    by_digest = {a.digest: a for a in adapters if a is not None}
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        cache.execute(plan.ops)
        cache.apply_tables(plan.tables)
        for op in plan.ops:
            if type(op) is LoadAdapter:
                cache.adapter_buffer(op.adapter_id).copy_(pattern(by_digest[op.adapter_id]))
        for adapter_id in cache.resident_adapters():
            assert torch.equal(cache.adapter_buffer(adapter_id), pattern(by_digest[adapter_id]))
        sampled = {s.seq_id: rng.randrange(1, 5) for s in plan.seqs if s.sample}
        for s in plan.seqs:
            sampled.update({c: rng.randrange(1, 5) for c in s.fork_ids})
        sched.update(sampled)
        check_matches(m, cache)
        steps += 1
        assert steps < 2000
    stats = m.adapter_stats()
    assert stats.loads >= 3 and stats.evictions >= 1 and stats.pinned == 0
    kv.close()


def test_a_paged_adapter_buffer_past_available_memory_fails_its_plan_and_changes_nothing(
        monkeypatch):
    """A paged adapter's bytes are new memory beside the block pool: checked against what the
    device has free before they are allocated (the plan fails whole, nothing allocated)."""
    from vmemkv.runtime import memory
    kv = kv_for("paged")
    m, cache = kv.manager, kv.cache
    adapter = ref("big", 3 * m.block_bytes)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: adapter.num_bytes - 1)
    m.begin()
    m.acquire_adapter(adapter)
    with pytest.raises(PlanExecutionError) as failed:
        cache.execute(m.take_ops())
    assert "LoRA adapter" in str(failed.value.__cause__)
    m.rollback()
    assert cache.resident_adapters() == {} and m.resident_adapters() == {}
    check_matches(m, cache)
    kv.close()
