"""close() never lets a wait return for a group that is not applied.

close() is what the atexit hook runs while an engine may still be stepping on a daemon thread:
a step thread blocked in wait_group(g) must come back only once group g is really mapped (close
finishes the plan in flight), and a plan submitted after close() is refused with MapperError,
not left for a thread that is gone (the step would write K/V into unmapped memory: SIGSEGV).
The mapper thread is held with an Event inside ``apply`` of group 0; no sleeps, no timeouts.
"""
import threading

import pytest

from vmemkv.runtime.cache.mapper import BackgroundMapper
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import MapperError
from vmemkv.runtime.kv import make_kv

NUM_GROUPS = 3


class HeldApply:
    """An apply function that records (plan, group) once applied; group 0 of the first plan
    waits for ``go`` (the mapper thread is held mid-mapping)."""

    def __init__(self) -> None:
        self.applied, self.in_group_0, self.go = [], threading.Event(), threading.Event()

    def __call__(self, plan, group: int) -> None:
        if group == 0 and not self.in_group_0.is_set():
            self.in_group_0.set()
            self.go.wait()
        self.applied.append((plan, group))


def close_on_a_thread(mapper: BackgroundMapper) -> threading.Thread:
    """Start close() on a thread; returns once close() has asked the mapper to stop and is
    joining its thread (the moment the old code woke every waiter)."""
    joining, join = threading.Event(), mapper._thread.join

    def join_after_signal(*args, **kwargs):
        joining.set()
        return join(*args, **kwargs)
    mapper._thread.join = join_after_signal
    closer = threading.Thread(target=mapper.close)
    closer.start()
    joining.wait()
    return closer


def release_when_the_waiter_blocks(mapper: BackgroundMapper, go: threading.Event) -> None:
    """Let the held mapper go on only once a waiter actually blocks on the mapper's condition
    (so a wait that returns without blocking is seen returning with group 0 unapplied)."""
    wait = mapper._cond.wait

    def wait_then_release(*args, **kwargs):
        go.set()
        return wait(*args, **kwargs)
    mapper._cond.wait = wait_then_release


def test_a_wait_under_way_when_close_comes_returns_only_once_its_group_is_applied():
    apply = HeldApply()
    mapper = BackgroundMapper(apply, NUM_GROUPS)
    closer = None
    try:
        mapper.submit("plan")
        apply.in_group_0.wait()            # the mapper thread is mapping group 0
        closer = close_on_a_thread(mapper)
        release_when_the_waiter_blocks(mapper, apply.go)
        mapper.wait_group(0)               # what write(layer 0) does first
        applied_at_return = list(apply.applied)
    finally:
        apply.go.set()
        if closer is not None:
            closer.join()
        mapper.close()
    assert ("plan", 0) in applied_at_return
    assert apply.applied == [("plan", g) for g in range(NUM_GROUPS)]  # close finished it
    assert not mapper.alive


def test_a_plan_submitted_after_close_is_refused_and_never_waited_on_as_mapped():
    apply = HeldApply()
    apply.in_group_0.set()                 # not held: nothing to hold
    mapper = BackgroundMapper(apply, NUM_GROUPS)
    mapper.submit("before")
    mapper.wait_all()
    mapper.close()
    with pytest.raises(MapperError, match="submitted after the background mapper was closed"):
        mapper.submit("after")
    mapper.wait_all()                      # the plan before close() is applied: returns
    mapper.wait_group(NUM_GROUPS - 1)
    assert apply.applied == [("before", g) for g in range(NUM_GROUPS)]
    assert not mapper.holds("after")


def test_a_plan_executed_after_the_mapper_closed_raises_typed_with_mappings_as_before():
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
    kv = make_kv(config, "vmem", page_bytes=4096, background_mapper=True)
    try:
        mgr = kv.manager
        mgr.allocate(0, 30)
        kv.execute(mgr.take_ops())
        kv.cache.wait_for_mapper()
        mapped_before = kv.cache.range.mapped_pages()
        assert len(mapped_before) > 0
        kv.cache._mapper.close()           # what the atexit hook does under a live engine
        mgr.begin()
        for seq_id in range(1, 3):
            mgr.allocate(seq_id, 60)
        ops = mgr.take_ops()
        assert ops
        with pytest.raises(MapperError, match="after the background mapper was closed"):
            kv.execute(ops)
        assert kv.cache.range.mapped_pages() == mapped_before   # nothing mapped, nothing lost
        mgr.rollback()
        kv.check_integrity()
    finally:
        kv.close()
