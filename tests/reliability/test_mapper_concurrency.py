"""The background mapper under random timings: random sleeps around submit and every wait in the
step thread, and inside every driver map/unmap on the mapper thread.

It never maps an address twice (the wrapping driver refuses and counts a second map), never
leaves a page group half mapped (after each step the range's mappings equal the manager's
tables, member by member), and shuts down cleanly on close, after an exception in the step
thread, and at interpreter exit.
"""
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..runtime.harness import ShadowRun
from .model import KiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def jitter(rng: random.Random, scale: float = 2e-4):
    lock = threading.Lock()

    def sleep(*_):
        with lock:
            seconds = rng.random() * scale
        time.sleep(seconds)
    return sleep


def jittery_run(seed: int, layout: str = "per-layer") -> tuple:
    rng = random.Random(seed)
    driver = FaultInjectingDriver(HostDriver(), delay=jitter(random.Random(seed + 1)))
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
    run = ShadowRun(config, "vmem", seed, backends=(), layout=layout, page_bytes=4 * KiB,
                    background_mapper=True, driver=driver,
                    cache_bytes=int(2.5 * 64 * config.bytes_per_token),
                    swap_bytes=2 * 64 * config.bytes_per_token)
    cache, sleep = run.cache, jitter(rng)
    execute, wait_group = cache.execute, cache._mapper.wait_group

    def slow_execute(ops):
        sleep()
        execute(ops)
        sleep()

    def slow_wait(group):
        sleep()
        wait_group(group)
    cache.execute = slow_execute
    cache._mapper.wait_group = slow_wait
    return run, driver


def make_room(run) -> None:
    """Free every sequence (a plan of its own, applied), so a new one of any length fits."""
    for seq_id in list(run.tokens):
        run.finish(seq_id)
    for seq_id in list(run.swapped):
        run.manager.free(seq_id)
    run.swapped.clear()
    run.cache.execute(run.manager.take_ops())
    run.cache.wait_for_mapper()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_no_double_map_and_no_half_mapping_under_random_timings(seed, layout):
    run, driver = jittery_run(seed, layout)
    for _ in range(40):
        run.step()                 # writes every layer while later layers are being mapped
        run.cache.check_integrity()
    assert driver.calls["map"] > 20
    assert driver.double_maps == 0
    assert run.cache.mapper_wait_s >= 0.0
    run.cache.close()
    assert not run.cache._mapper.alive
    assert driver.mapped_addresses == 0


def test_close_finishes_the_plan_in_flight_then_stops():
    run, driver = jittery_run(7)
    for _ in range(5):
        run.step()
    mgr = run.manager
    make_room(run)
    mgr.allocate(100, 60)
    ops = mgr.take_ops()
    assert ops
    run.cache.execute(ops)         # returns at once; mapping goes on on the thread
    mapper = run.cache._mapper
    mapper.close()                 # waits for the plan, then stops the thread
    assert not mapper.alive
    run.cache.check_integrity()    # every page of that plan is mapped, none half done
    run.cache.close()
    assert driver.double_maps == 0 and driver.mapped_addresses == 0


def test_exception_in_the_step_thread_then_close_is_clean():
    run, driver = jittery_run(8)
    with pytest.raises(ZeroDivisionError):
        for step in range(20):
            run.step()
            if step == 10:
                make_room(run)
                run.manager.allocate(200, 50)
                run.cache.execute(run.manager.take_ops())
                1 / 0              # the step thread dies mid-plan
    run.cache.close()
    assert not run.cache._mapper.alive
    assert driver.mapped_addresses == 0 and driver.double_maps == 0


def test_a_fault_on_the_mapper_thread_is_undone_and_reported_at_the_next_wait():
    from vmemkv.runtime.errors import MapperError, PlanExecutionError
    run, driver = jittery_run(9)
    for _ in range(5):
        run.step()
    mgr, cache = run.manager, run.cache
    make_room(run)
    mapped_before = cache.range.mapped_pages()
    mgr.begin()
    for seq_id in range(300, 304):     # one page each, on every slot: some must be mapped
        mgr.allocate(seq_id, 30)
    ops = mgr.take_ops()
    assert any(type(op).__name__ == "MapExtent" for op in ops)
    driver.fail_at("map", 1)
    cache.execute(ops)
    with pytest.raises(MapperError) as info:
        cache.wait_for_mapper()
    assert isinstance(info.value, PlanExecutionError) and info.value.rolled_back
    mgr.rollback()
    assert cache.range.mapped_pages() == mapped_before
    cache.check_integrity()
    run.check_contents()
    for _ in range(5):             # and the cache keeps serving
        run.step()
    cache.close()


SCRIPT = textwrap.dedent("""
    import random, sys, time
    sys.path.insert(0, {root!r})
    from vmemkv.runtime.kv import make_kv
    from vmemkv.runtime.config import CacheConfig
    from vmemkv.vmem.faults import FaultInjectingDriver
    from vmemkv.vmem.host import HostDriver
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
    driver = FaultInjectingDriver(HostDriver(), delay=lambda kind: time.sleep(0.002))
    cache = make_kv(config, "vmem", page_bytes=4096, background_mapper=True, driver=driver)
    mgr = cache.manager
    for seq_id in range(3):
        mgr.allocate(seq_id, 60)
    cache.execute(mgr.take_ops())     # still mapping when the script ends
    if {fail!r}:
        raise ValueError("boom")
    print("done")
""")


@pytest.mark.parametrize("fail", [False, True])
def test_interpreter_exit_without_close_is_clean(fail):
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT, fail=fail)],
                            capture_output=True, text=True, timeout=60)
    if not fail:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "done"
        assert result.stderr == ""
    else:
        assert result.returncode == 1
        assert result.stderr.count("Traceback") == 1 and "ValueError: boom" in result.stderr
        assert "vmemkv-mapper" not in result.stderr and "Exception in thread" not in result.stderr
