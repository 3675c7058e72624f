"""Engines sharing one MemoryBudget (runtime/engine/elastic.py, scheduler/budget.py): an engine
dropped without close() and collected while another engine's step reads the budget's shares
breaks nothing (its finalizer unregistered it there: "dictionary changed size during iteration"
out of the other engine's step), and an engine that asked its neighbour for memory and then went
to sleep no longer keeps the neighbour giving pages back for nobody."""
from __future__ import annotations

import gc
import weakref

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.budget import BudgetShare, MemoryBudget

from .conftest import hf_greedy, model, tokens

KiB = 1024
OPTS = dict(page_bytes=4096, layout="per-layer", check_integrity=True)


def test_an_engine_collected_inside_another_engines_step_breaks_nothing(monkeypatch):
    budget = MemoryBudget(512 * KiB, idle_release_s=100.0)
    a, c = (Engine(model(), memory_budget=budget, cache_bytes=64 * KiB,
                   min_cache_bytes=32 * KiB, max_context=256, max_batch=2, **OPTS)
            for _ in range(2))
    dropped = weakref.ref(c)
    read_ages = BudgetShare._blocked_age

    def collect_while_reading(share):        # the GC runs at an allocation in the budget
        if dropped() is not None:
            gc.collect()
        return read_ages(share)
    gc.disable()
    try:
        del c                                 # only the cyclic GC frees it
        assert dropped() is not None and len(budget.stats()["shares"]) == 2
        monkeypatch.setattr(BudgetShare, "_blocked_age", collect_while_reading)
        prompt = list(range(1, 21))
        rid = a.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
        a.step()                              # it raised RuntimeError
        assert dropped() is None              # collected inside a's step
        monkeypatch.undo()
    finally:
        gc.enable()
    assert list(budget.stats()["shares"]) == [a.memory_share.name]
    assert budget.held_bytes == a.cache_bytes == 64 * KiB
    a.run_until_done()
    assert tokens([a.output(rid)]) == hf_greedy("tiny-llama", [prompt], 4, ignore_eos=True)
    a.close()
    assert budget.stats()["shares"] == {} and budget.held_bytes == 0


def test_a_sleeping_engine_leaves_no_pressure_on_its_neighbour():
    """b asks a for 32 KiB, then sleeps: a (busy, nothing waiting) gave 32 KiB back at its next
    step, for nobody (unclaimed), and would for as long as b slept."""
    clock = [0.0]
    budget = MemoryBudget(256 * KiB, idle_release_s=1.0, clock=lambda: clock[0])
    opts = dict(OPTS, max_context=512, max_batch=2)
    a = Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=192 * KiB,
               min_cache_bytes=32 * KiB, **opts)
    b = Engine(model("tiny-qwen2"), memory_budget=budget, cache_bytes=64 * KiB,
               min_cache_bytes=32 * KiB, **opts)
    b.step()
    clock[0] += 2.0
    b.step()                                  # idle: back to its minimum
    assert a.resize_cache(224 * KiB) == 224 * KiB and budget.stats()["unclaimed_bytes"] == 0
    prompt = list(range(1, 21))
    ra = a.add_request(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    a.step()

    def pressure_on_a():
        return budget.stats()["shares"][a.memory_share.name].pressure_bytes
    rb = b.add_request(list(range(1, 101)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    b.step()                                  # b cannot run: it asks a
    assert pressure_on_a() == 32 * KiB and b.cache_bytes == 32 * KiB
    b.sleep()
    assert pressure_on_a() == 0
    for _ in range(5):
        a.step()
        clock[0] += 0.01
    assert a.cache_bytes == 224 * KiB and budget.stats()["shares"][a.memory_share.name].gives == 0
    assert budget.stats()["unclaimed_bytes"] == 0
    b.wake()
    b.step()                                  # b asks again: its pressure is back
    assert pressure_on_a() == 32 * KiB
    b.abort(rb)
    a.run_until_done()
    assert tokens([a.output(ra)]) == hf_greedy("tiny-llama", [prompt], 200, ignore_eos=True)
    a.close()
    b.close()


def test_engines_on_one_budget_are_named_in_the_order_they_were_built_not_by_address():
    """A tie between equally spare shares goes by name (scheduler/budget.py): an engine's share
    was named by its object's address, so which engine gave first could change from run to
    run; it is numbered in this process's construction order."""
    budget = MemoryBudget(512 * KiB, idle_release_s=100.0)
    a, b = (Engine(model(), memory_budget=budget, cache_bytes=64 * KiB,
                   min_cache_bytes=32 * KiB, max_context=256, max_batch=2, **OPTS)
            for _ in range(2))
    try:
        (kind_a, number_a), (kind_b, number_b) = (e.memory_share.name.rsplit("-", 1)
                                                  for e in (a, b))
        assert kind_a == kind_b == a.model.config.model_type
        assert int(number_b) == int(number_a) + 1
    finally:
        a.close()
        b.close()
