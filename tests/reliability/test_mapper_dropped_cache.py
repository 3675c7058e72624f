"""A cache (or an Engine) with a background mapper, dropped without close(), frees its KV memory
when Python collects it, as one without a mapper does (docs/usage.md), and its mapper thread
ends. The old mapper thread held the mapper, whose ``apply`` is the cache's bound method: the
cache stayed reachable for the whole process (its memfd pages and its thread with it)."""
from __future__ import annotations

import gc

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.kv import make_kv
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..engine.test_elastic_engine import memfd_bytes, model
from .model import KiB, small_config

HANG_GUARD_S = 10.0      # only so that a thread that never ends fails the test, not hangs it


def mapper_threads(kv) -> list:
    """The cache's mapper thread (none without a mapper)."""
    mapper = kv.cache._mapper
    return [] if mapper is None else [mapper._thread]


def drop_and_check(make, background_mapper: bool) -> None:
    """``make()`` returns (owner, its KV); drop the owner, collect, and check that the memory the
    owner held is freed and its mapper thread has ended."""
    gc.collect()
    base_bytes = memfd_bytes()
    owner, kv = make()
    threads = mapper_threads(kv)
    assert len(threads) == int(background_mapper) and all(t.is_alive() for t in threads)
    held_bytes = memfd_bytes() - base_bytes
    assert held_bytes >= 4 * KiB          # something to free: the pool's pages
    del owner, kv
    gc.collect()
    assert memfd_bytes() - base_bytes == 0, f"{held_bytes} bytes held, not freed on collection"
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), "the mapper thread of a collected cache still runs"


@pytest.mark.parametrize("background_mapper", [False, True])
def test_a_dropped_cache_frees_its_memory_and_ends_its_mapper_thread(background_mapper):
    def make():
        kv = make_kv(small_config(), page_bytes=4 * KiB, background_mapper=background_mapper)
        return kv, kv
    drop_and_check(make, background_mapper)


@pytest.mark.parametrize("background_mapper", [False, True])
def test_a_dropped_engine_frees_its_memory_after_generating(background_mapper):
    def make():
        engine = Engine(model(), cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64,
                        background_mapper=background_mapper)
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert out[0].status == "finished" and len(out[0].outputs[0].token_ids) == 6
        return engine, engine.kv
    drop_and_check(make, background_mapper)


def test_a_cache_dropped_with_a_failed_plan_unreported_frees_its_memory():
    """The mapper holds the failure (its deferred undo names the cache) until the next wait;
    dropped before that wait, the cache is still collected, its pages unmapped and freed."""
    driver = FaultInjectingDriver(HostDriver())

    def make():
        kv = make_kv(small_config(), page_bytes=4 * KiB, background_mapper=True, driver=driver)
        kv.manager.allocate(0, 40, token_ids=[1] * 40)
        driver.fail_at("map", 1)
        kv.cache.execute(kv.manager.take_ops())     # returns once submitted: fails on the thread
        mapper = kv.cache._mapper
        with mapper._cond:
            assert mapper._cond.wait_for(lambda: mapper._error is not None, HANG_GUARD_S)
        return kv, kv
    drop_and_check(make, background_mapper=True)
    assert driver.faults_raised["map"] == 1 and driver.mapped_addresses == 0
