"""A memory plan that fails part-way (a driver call, an out-of-memory) costs the engine nothing:
the cache undoes the plan, the step is retried, and every request still finishes with exactly
transformers' greedy tokens. A persistent fault reaches the caller as a typed error and the
engine resumes once the fault is gone."""
from __future__ import annotations

import pytest

from vmemkv import vmem
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.vmem.faults import FaultInjectingDriver

from .conftest import hf_greedy, model, prompts, tokens

KiB = 1024
SMALL_PAGES = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64,
                   check_integrity=True)


@pytest.mark.parametrize("background_mapper", [False, True])
@pytest.mark.parametrize("fail_call", [0, 5, 17])
def test_transient_map_failure_is_retried_and_output_exact(fail_call, background_mapper):
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = prompts(6, 8, 40, seed=11)
    with Engine(model(), driver=driver, background_mapper=background_mapper,
                **SMALL_PAGES) as engine:
        driver.fail_at("map", fail_call)
        out = engine.generate(batch, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert driver.faults_raised["map"] == 1 and engine.plan_failures == 1
        engine.cache.check_integrity()
    assert tokens(out) == hf_greedy("tiny-llama", batch, 12, ignore_eos=True)


def test_persistent_failure_raises_typed_error_then_resumes_when_cleared():
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = prompts(4, 20, 40, seed=12)
    with Engine(model(), driver=driver, max_plan_retries=2, **SMALL_PAGES) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
               for p in batch]
        engine.step()                                    # prefill: pages mapped fine
        driver.fail_at("map", 0, persistent=True)        # every later map fails
        with pytest.raises(PlanExecutionError) as info:
            engine.run_until_done()
        assert info.value.rolled_back and engine.plan_failures == 3   # 1 + 2 retries
        assert engine.has_unfinished()
        engine.cache.manager.check_integrity()
        driver.disarm()
        engine.run_until_done()                          # the same engine keeps serving
        engine.cache.check_integrity()                   # memory matches the manager again
        out = [engine.output(rid, pop=True) for rid in ids]
    assert tokens(out) == hf_greedy("tiny-llama", batch, 20, ignore_eos=True)
