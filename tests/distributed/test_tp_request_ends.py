"""Ending a request early under tensor parallelism (gloo, 2 ranks on the CPU): what an abort or a
failure frees leaves rank 0's manager as a plan and runs on EVERY rank, as a step's plan does, so
no rank keeps the ended request's swap buffer, part mappings, bound pages or placements.

One spawned engine (a hybrid Gemma 3: FULL and WINDOW parts, pages bound to parts, swap
preemption) serves the three cases; each ends every request it starts and then checks that
every rank is back at baseline: no placement, no host copy, no live token, and the same parts
mapped and pages bound on every rank as rank 0's manager holds (groups freed stay mapped for
reuse, deferred, on every rank alike). Rank states come from ``TensorParallel.memory_states``.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vmemkv import vmem
from vmemkv.runtime.engine import Engine, SamplingParams

from ..engine.test_engine_faults import SlotFaultDriver, slot_spans
from ..hf.window_families import build

KiB = 1024
PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)


def prompt(length: int, seed: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@pytest.fixture(scope="class")
def hybrid_tp():
    """Per rank: 64 tokens a page group, 24 pool pages (2 whole groups of 12: FULL 2, WINDOW
    10), so three 56-token prompts growing past 64 tokens swap one out within ten steps."""
    driver = SlotFaultDriver(vmem.open_driver("host"))
    with Engine(build("gemma3"), driver=driver, tensor_parallel_size=2, max_batch=4,
                max_context=128, cache="vmem", layout="per-layer", page_bytes=4 * KiB,
                cache_bytes=24 * 4 * KiB, preemption="swap", swap_bytes=1 << 20,
                max_plan_retries=0, check_integrity=True, self_check=False) as engine:
        assert engine.kv.manager.tokens_per_page == 64 and engine.kv.cache.pool_pages == 24
        yield SimpleNamespace(engine=engine, driver=driver)


def assert_ranks_agree(engine) -> list:
    """Every rank maps the parts and binds the pages rank 0's manager does, holds the host
    copies of the sequences the manager has swapped out (same tokens) and places only what
    rank 0 places; rank 0's cache matches its manager. Returns the rank states."""
    engine.kv.check_integrity()
    manager, states = engine.kv.manager, engine.tp.memory_states()
    truth = {slot: manager.mapped_extents(slot) for slot in range(4)}
    assert len(states) == 2
    for rank, state in enumerate(states):
        assert state["mapped_extents"] == truth, f"rank {rank}: pool pages mapped"
        assert state["mapped_pool_pages"] == states[0]["mapped_pool_pages"], f"rank {rank}: pages"
        assert state["swapped_tokens"] == {s: manager.num_tokens(s) for s in state["swapped_tokens"]
                                           if manager.is_swapped(s)} == states[0]["swapped_tokens"]
        assert state["placements"] == states[0]["placements"], f"rank {rank}: placements"
    return states


def assert_at_baseline(engine) -> None:
    assert not engine.has_unfinished()
    states = assert_ranks_agree(engine)
    manager = engine.kv.manager
    assert manager.stats().live_tokens == 0 and manager.kv_cache_usage() == 0.0
    assert manager.swap_free_bytes == manager.swap_bytes
    for state in states:
        assert state["placements"] == {} and state["swapped_tokens"] == {}
        assert state["swapped_bytes"] == 0


def seq_of(engine, rid: int) -> int:
    return engine._requests[rid].seq_ids[0]


def end_all(engine, rids) -> None:
    for rid in rids:
        if engine.status(rid) in ("waiting", "running", "swapped"):
            engine.abort(rid)


class TestRequestEndsReachEveryRank:
    def test_aborting_a_running_request_frees_its_parts_on_every_rank(self, hybrid_tp):
        engine = hybrid_tp.engine
        long_rid = engine.add_request(prompt(60, 1), PARAMS)
        short_rid = engine.add_request(prompt(10, 2), PARAMS)
        seq = seq_of(engine, long_rid)
        for _ in range(16):                # 71 tokens computed: page 0 is behind the window
            engine.step()
            slot = engine.kv.manager.slot_of(seq)
            if engine.kv.manager._win_gone[slot]:
                break
        assert engine.status(long_rid) == "running" and engine.kv.manager._win_gone[slot] == 1
        bound = engine.kv.manager.bound_pages
        engine.abort(long_rid)
        states = assert_ranks_agree(engine)
        assert engine.kv.manager.bound_pages < bound            # its FULL-only page went back
        assert all(seq not in s["placements"] and s["mapped_extents"][slot].get(0) is None
                   for s in states)
        engine.abort(short_rid)
        assert_at_baseline(engine)

    def test_aborting_a_swapped_request_drops_its_host_copy_on_every_rank(self, hybrid_tp):
        engine = hybrid_tp.engine
        rids = [engine.add_request(prompt(56, 10 + i), PARAMS) for i in range(3)]
        for _ in range(20):
            engine.step()
            if engine.scheduler.swapped:
                break
        victim = engine.scheduler.swapped[0]
        rid = victim.request.request_id
        before = engine.tp.memory_states()
        held = engine.kv.manager.num_tokens(victim.seq_id)
        assert [s["swapped_tokens"] for s in before] == [{victim.seq_id: held}] * 2
        assert before[0]["swapped_bytes"] == before[1]["swapped_bytes"] > 0   # a KV head each
        engine.abort(rid)
        assert engine.status(rid) == "aborted"
        states = assert_ranks_agree(engine)
        assert [s["swapped_tokens"] for s in states] == [{}, {}]
        assert [s["swapped_bytes"] for s in states] == [0, 0]
        end_all(engine, rids)
        assert_at_baseline(engine)

    def test_a_request_failed_by_a_persistent_fault_is_freed_on_every_rank(self, hybrid_tp):
        engine, driver = hybrid_tp.engine, hybrid_tp.driver
        victim = engine.add_request(prompt(60, 20), PARAMS)
        other = engine.add_request(prompt(10, 21), PARAMS)
        failures = engine.plan_failures
        engine.step()                                  # both prefilled: one page group each
        slot = engine.kv.manager.slot_of(seq_of(engine, victim))
        driver.spans = slot_spans(engine.kv.cache, slot)   # rank 0 fails every map of that slot
        try:
            for _ in range(8):                         # growing past 64 tokens maps page 1
                engine.step()
                if engine.status(victim) == "failed":
                    break
        finally:
            driver.spans = []
        assert engine.status(victim) == "failed" and engine.plan_failures == failures + 1
        assert engine.output(victim).error.type == "PlanExecutionError"
        states = assert_ranks_agree(engine)
        assert all(s["mapped_extents"][slot].keys() <= {0} for s in states)   # page 1 never mapped
        assert engine.status(other) == "running"
        engine.abort(other)
        assert_at_baseline(engine)
