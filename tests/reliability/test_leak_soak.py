"""Leak soak: 10,000 request lifecycles (admit, grow, sometimes fork / swap, free; about 500
forks, 300 swaps and 4,000 page maps) through a vmem manager and cache, executing every plan,
leave the process's mappings, file descriptors and the cache's pages exactly where they started
(``VMEMKV_SOAK_LIFECYCLES=1000000`` soaks longer).

Tiny requests and a tiny pool, so pages are reclaimed and remapped all the time (about one
map/unmap pair per lifecycle); no attention runs, only manager + cache.execute. And 150 engine
requests, a third aborted at random points, leave nothing held either.
"""
import gc
import os
import random

import pytest

from vmemkv.runtime.kv import make_kv
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from .. import process_resources
from .model import small_config

LIFECYCLES = int(os.environ.get("VMEMKV_SOAK_LIFECYCLES", 10_000))
SAMPLE_EVERY = max(1, LIFECYCLES // 4)     # the process's resources, sampled 4 times


def pages_state(cache):
    m = cache.manager
    tpp = m.tokens_per_page      # reclaimable: unused groups kept (still mapped, or cached)
    return {"free_groups": m.stats().free_tokens // tpp, "reclaimable": m.reclaimable_tokens // tpp,
            "mapped_indices": cache.range.num_mapped_pages, "pool_free": cache.pool.free_pages,
            "pool_mapped": cache.pool.mapped_pages}


def lifecycle(cache, rng, seq_id):
    """One request: admit, grow, maybe fork or swap out and back, free everything."""
    mgr = cache.manager
    n = rng.randint(1, 40)
    ids = [rng.randrange(3) for _ in range(n)] if rng.random() < 0.3 else None
    mgr.allocate(seq_id, n, token_ids=ids)
    cache.execute(mgr.take_ops())
    for _ in range(rng.randint(0, 3)):
        if mgr.can_append(seq_id, 8):
            mgr.append(seq_id, 8)
            cache.execute(mgr.take_ops())
    held = [seq_id]
    roll = rng.random()
    if roll < 0.05 and mgr.can_fork(seq_id):
        mgr.fork(seq_id, -seq_id - 1)
        held.append(-seq_id - 1)
        if mgr.can_append(-seq_id - 1, 1):
            mgr.append(-seq_id - 1, 1)
    elif roll < 0.08 and mgr.can_swap_out(seq_id):
        mgr.swap_out(seq_id)
        cache.execute(mgr.take_ops())
        if mgr.can_swap_in(seq_id):
            mgr.swap_in(seq_id)
    cache.execute(mgr.take_ops())
    for s in held:
        mgr.free(s)
    cache.execute(mgr.take_ops())


@pytest.mark.slow
def test_ten_thousand_lifecycles_leak_nothing():
    config = small_config(max_batch=6, max_context=64)
    with process_resources.watch() as watch:
        _soak(config, watch)


def _soak(config, watch):
    start_process = watch.snapshot()
    driver = FaultInjectingDriver(HostDriver())    # no faults: counts calls, catches double maps
    cache = make_kv(config, "vmem", page_bytes=4096, layout="per-layer", driver=driver,
                       cache_bytes=3 * 32 * config.bytes_per_token,  # 3 page groups
                       swap_bytes=64 * config.bytes_per_token)
    # warm up until the pool is full of deferred pages: from then on every state is reached
    rng = random.Random(0)
    for seq_id in range(200):
        lifecycle(cache, rng, seq_id)
    start_pages = pages_state(cache)
    start_live = watch.snapshot()
    samples = []
    for seq_id in range(200, 200 + LIFECYCLES):
        lifecycle(cache, rng, seq_id)
        if seq_id % SAMPLE_EVERY == 0:
            samples.append(watch.snapshot())
    # deferred reclamation reuses pages in place where it can; still ~0.4 page maps per lifecycle
    assert min(driver.calls["map"], driver.calls["unmap"]) > LIFECYCLES // 4
    assert driver.double_maps == 0
    cache.manager.check_integrity()
    cache.check_integrity()
    assert not cache.manager._seqs and not cache.manager._swapped and not cache._swapped
    # every group is free or deferred (mapped or cached, reclaimable), as at the start
    end_pages = pages_state(cache)
    assert end_pages["free_groups"] + end_pages["reclaimable"] == cache.manager.num_groups
    assert end_pages["pool_free"] == start_pages["pool_free"]
    # mappings of the range split VMAs, so the live count depends on which pages are mapped;
    # with the same pages mapped it must be identical, and it never drifts upward
    fds = {sample[1:] for sample in samples}   # memfd fds, fds, live reservations
    assert fds == {start_live[1:]}, f"fds or reservations moved: {start_live} -> {sorted(fds)}"
    bound = start_live.memfd_mappings + 2 * cache.pool.total_pages
    assert max(sample.memfd_mappings for sample in samples) <= bound, (start_live, samples)
    cache.close()
    assert watch.snapshot() == start_process, (start_process, watch.snapshot())
    print(f"{LIFECYCLES} lifecycles: {driver.calls['map']} maps, {driver.calls['unmap']} unmaps")


ENGINE_REQUESTS = int(os.environ.get("VMEMKV_SOAK_ENGINE_REQUESTS", 150))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_engine_requests_aborted_at_random_points_leak_nothing(preemption):
    """Requests through a real engine on a tight cache, a third of them aborted at a random
    step (waiting, running, preempted or swapped): afterwards the manager holds nothing, the
    swap space is empty, the pages mapped are only deferred ones, and the process's file
    descriptors are where they started."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import build_model

    rng = random.Random(1)
    gc.collect()
    fds_before = process_resources.Watch().snapshot().fds
    with Engine(build_model("tiny-llama"), cache="vmem", page_bytes=4096, max_batch=4,
                max_context=64, cache_bytes=5 * 16 * 1024, preemption=preemption,
                swap_bytes=1 << 20 if preemption == "swap" else 0,
                prefix_sharing=True) as engine:
        live, statuses = [], set()
        for _ in range(ENGINE_REQUESTS):
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 40))]
            live.append(engine.add_request(prompt, SamplingParams(max_new_tokens=rng.randint(1, 20),
                                                                  ignore_eos=True)))
            if rng.random() < 0.5:
                engine.step()
            alive = [rid for rid in live if engine.status(rid) in ("waiting", "running", "swapped")]
            if alive and rng.random() < 0.33:
                rid = rng.choice(alive)
                statuses.add(engine.status(rid))
                engine.abort(rid)
        engine.run_until_done()
        assert {engine.output(rid, pop=True).status for rid in live} == {"finished", "aborted"}
        mgr = engine.cache.manager
        assert mgr.stats().live_tokens == 0 and engine.cache.swapped_bytes == 0
        assert mgr.stats().free_tokens + mgr.reclaimable_tokens == mgr.stats().total_tokens
        engine.cache.check_integrity()
        assert {"waiting", "running"} <= statuses
    gc.collect()
    assert process_resources.Watch().snapshot().fds == fds_before
