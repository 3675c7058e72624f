"""A Ctrl-C that lands as a cache's plan execution returns: the memory ops are applied, and
the planners must keep them. Before ``deferred_interrupts`` (runtime/interrupts.py) the step's
KeyboardInterrupt rolled the manager back over pages the cache had mapped (ModelRunner set
``ops_applied`` one line too late), and a sleep's (``StepTransaction.run``) rolled the resize
back after the cache had unmapped every page: the manager and the cache disagreed and
``check_integrity`` failed. The signal is raised for real (``signal.raise_signal``) at the end
of the cache's ``execute``, so it is delivered exactly there."""
from __future__ import annotations

import signal

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model, prompts

ENGINE = dict(cache="vmem", max_batch=2, max_context=64, page_bytes=4096)


def interrupt_after_plans(cache, when) -> list:
    """Raise SIGINT as ``cache.execute`` returns from a plan with ops for which ``when()``
    holds (the first such plan only); returns the list the interrupted plans' ops go to."""
    execute, hit = cache.execute, []

    def execute_then_interrupt(ops):
        execute(ops)
        if ops and not hit and when():
            hit.append(list(ops))
            signal.raise_signal(signal.SIGINT)
    cache.execute = execute_then_interrupt
    return hit


def check_agree(engine) -> None:
    engine.kv.manager.check_integrity()
    engine.kv.check_integrity()     # memory and replica equal the manager's tables


@pytest.mark.parametrize("at_plan", [1, 2, 3])
def test_a_ctrl_c_as_a_steps_memory_ops_return_keeps_them_in_the_manager(at_plan):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    batch = prompts(2, 9, 14, seed=8)
    with Engine(model(), **ENGINE) as engine:
        want = [o.outputs[0].token_ids for o in engine.generate(batch, params)]
        engine.sleep()
        engine.wake()                  # every page unmapped: the run maps its own
        plans = []
        hit = interrupt_after_plans(engine.runner.cache,
                                    lambda: plans.append(1) or len(plans) == at_plan)
        ids = [engine.add_request(p, params) for p in batch]
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        assert hit, "the interrupt was raised"
        check_agree(engine)
        engine.run_until_done()
        got = [engine.output(rid, pop=True).outputs[0].token_ids for rid in ids]
        check_agree(engine)
        assert engine.kv.manager.stats().live_tokens == 0
    assert got == want


def test_a_ctrl_c_as_sleeps_unmapping_returns_leaves_the_engine_asleep():
    """Sleep unmaps every page in one ``StepTransaction.run``: interrupted as the unmapping
    returns, the engine is asleep, its manager holds no page, and it wakes and finishes."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    batch = prompts(2, 12, 18, seed=2)
    with Engine(model(), **ENGINE) as engine:
        want = [o.outputs[0].token_ids for o in engine.generate(batch, params)]
        ids = [engine.add_request(p, params) for p in batch]
        for _ in range(4):
            engine.step()
        cache_bytes = engine.cache_bytes
        sleeping = []
        hit = interrupt_after_plans(engine.runner.cache, lambda: bool(sleeping))
        sleeping.append(True)
        with pytest.raises(KeyboardInterrupt):
            engine.sleep()
        assert hit, "the sleep's plan had ops and was interrupted"
        assert engine.is_sleeping and engine.cache_bytes == 0
        check_agree(engine)
        assert engine.wake() == cache_bytes
        engine.run_until_done()
        got = [engine.output(rid, pop=True).outputs[0].token_ids for rid in ids]
        check_agree(engine)
    assert got == want
