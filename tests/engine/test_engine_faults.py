"""A step is a transaction over scheduler + manager + cache. A memory plan that fails part-way
(a driver call, an out-of-memory) is undone by the cache and rolled back by both, so the step
leaves no trace; the next step schedules afresh and every request still finishes with exactly
transformers' greedy tokens. A persistent fault that belongs to one request ends that request
"failed" and the others go on; one that belongs to nobody reaches the caller as a typed error
after bounded retries, and the engine resumes once the fault is gone."""
from __future__ import annotations

import pytest

from vmemkv import vmem
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.vmem import DriverCallError
from vmemkv.vmem.faults import FaultInjectingDriver

from .conftest import engine_state, hf_greedy, model, prompts, tokens

KiB = 1024
SMALL_PAGES = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64,
                   check_integrity=True)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("background_mapper", [False, True])
@pytest.mark.parametrize("fail_call", [0, 5, 17])
def test_transient_map_failure_is_retried_and_output_exact(fail_call, background_mapper):
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = prompts(6, 8, 40, seed=11)
    with Engine(model(), driver=driver, background_mapper=background_mapper,
                **SMALL_PAGES) as engine:
        driver.fail_at("map", fail_call)
        out = engine.generate(batch, GREEDY)
        assert driver.faults_raised["map"] == 1 and engine.plan_failures == 1
        assert all(o.status == "finished" for o in out)
        engine.cache.check_integrity()
    assert tokens(out) == hf_greedy("tiny-llama", batch, 12, ignore_eos=True)


@pytest.mark.parametrize("background_mapper", [False, True])
def test_a_fault_at_every_map_of_every_step_leaves_no_trace(background_mapper):
    """Every step of a run is first failed at its 1st map call, then its 2nd, ... until it
    makes no more maps: each failure leaves scheduler, manager and memory exactly as before
    the step, and the tokens are transformers' greedy tokens."""
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = prompts(6, 8, 40, seed=11)
    with Engine(model(), driver=driver, background_mapper=background_mapper,
                max_plan_retries=10**6, **SMALL_PAGES) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        failures = 0
        while engine.has_unfinished():
            for call in range(10**6):
                before = engine_state(engine)
                driver.fail_at("map", call)
                try:
                    engine.step()
                except PlanExecutionError as error:
                    assert error.rolled_back and isinstance(error.__cause__, (DriverCallError,
                                                                              PlanExecutionError))
                    assert engine_state(engine) == before, f"step changed state, map call {call}"
                    failures += 1
                    continue
                finally:
                    driver.disarm()
                break
        assert failures == engine.plan_failures >= 20
        engine.cache.check_integrity()
        out = [engine.output(rid, pop=True) for rid in ids]
    assert tokens(out) == hf_greedy("tiny-llama", batch, 12, ignore_eos=True)


class SlotFaultDriver(FaultInjectingDriver):
    """Every map of an address inside ``spans`` ([start, end) byte ranges) fails."""

    spans: list = []

    def map(self, address, handle, page_bytes):
        if any(lo <= address < hi for lo, hi in self.spans):
            raise DriverCallError(f"map: injected persistent fault at {address:#x}")
        super().map(address, handle, page_bytes)


def slot_spans(cache, slot: int) -> list:
    """Byte ranges of every layer's K and V row of ``slot`` (per-layer layout)."""
    spans = []
    for layer in range(cache.config.num_layers):
        for t in cache.layer_tensors(layer):
            row = t[slot]
            spans.append((row.data_ptr(), row.data_ptr() + row.numel() * row.element_size()))
    return spans


@pytest.mark.parametrize("retries", [0, 2])
def test_a_persistent_fault_of_one_request_fails_it_and_the_others_finish(retries):
    driver = SlotFaultDriver(vmem.open_driver("host"))
    batch = prompts(4, 20, 40, seed=12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Engine(model(), driver=driver, max_plan_retries=retries, **SMALL_PAGES) as engine:
        ids = [engine.add_request(p, params) for p in batch]
        engine.step()                                    # prefill: one page per sequence
        # the victim's prompt fits one 32-token page; growing to prompt + 20 needs a second
        victim = next(i for i, p in enumerate(batch) if len(p) < 30)
        seq = next(s for s in engine.scheduler.running if s.request.request_id == ids[victim])
        slot = engine.cache.manager.slot_of(seq.seq_id)
        driver.spans = slot_spans(engine.cache, slot)
        engine.run_until_done()                          # no error reaches the caller
        out = [engine.output(rid, pop=True) for rid in ids]
        assert engine.plan_failures == retries + 1
        stats = engine.cache.manager.stats()
        assert stats.live_tokens == 0 and not engine.has_unfinished()
        engine.cache.check_integrity()
    want = hf_greedy("tiny-llama", batch, 20, ignore_eos=True)
    failed = out[victim]
    assert failed.status == "failed" and failed.error.type == "PlanExecutionError"
    assert "injected persistent fault" in failed.error.message
    assert failed.outputs[0].finish_reason == "error"
    got = failed.outputs[0].token_ids
    assert 0 < len(got) < 20 and got == want[victim][:len(got)]
    others = [i for i in range(len(batch)) if i != victim]
    assert [out[i].status for i in others] == ["finished"] * len(others)
    assert [tokens(out)[i] for i in others] == [want[i] for i in others]


def test_an_unattributable_persistent_fault_raises_then_resumes_when_cleared():
    """Unmapping a deferred page (reclaiming it) serves whoever maps next: a fault there is
    nobody's, so after ``max_plan_retries`` retries it reaches the caller, typed."""
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    options = dict(SMALL_PAGES, max_context=96, cache_bytes=3 * 16 * KiB)   # 3 page groups
    short, long = prompts(3, 8, 10, seed=13), prompts(1, 70, 70, seed=14)
    with Engine(model(), driver=driver, max_plan_retries=2, **options) as engine:
        first = engine.generate(short, SamplingParams(max_new_tokens=4, ignore_eos=True))
        rid = engine.add_request(long[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
        driver.fail_at("unmap", 0, persistent=True)      # reclaiming any deferred page fails
        with pytest.raises(PlanExecutionError) as info:
            engine.run_until_done()
        assert info.value.rolled_back and engine.plan_failures == 3   # 1 + 2 retries
        assert engine.has_unfinished() and engine.status(rid) == "waiting"
        engine.cache.check_integrity()
        driver.disarm()
        engine.run_until_done()                          # the same engine keeps serving
        engine.cache.check_integrity()
        out = engine.output(rid, pop=True)
    assert tokens(first) == hf_greedy("tiny-llama", short, 4, ignore_eos=True)
    assert tokens([out]) == hf_greedy("tiny-llama", long, 4, ignore_eos=True)
