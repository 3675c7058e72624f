"""Engines sharing one MemoryBudget (scheduler/budget.py's liveness rule, runtime/engine/elastic.py):
two engines whose requests each need more than half of it both finish (they deadlocked), a busy
engine yields to a neighbour that cannot run (it starved it while it had a queue), two threads
growing at once stay within the total (both took the same unclaimed bytes), an engine dropped or
failing construction leaves the budget, wake() does not grow for the preemptions sleep() made,
and min_cache_bytes is checked by name. Tokens equal transformers' greedy throughout."""
from __future__ import annotations

import gc
import threading

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.scheduler.budget import MemoryBudget

from .conftest import hf_greedy, model, tokens

KiB = 1024
OPTS = dict(page_bytes=4096, layout="per-layer", check_integrity=True)


def _idle_to_min(engine, clock) -> None:
    engine.step()
    clock[0] += 2.0
    engine.step()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_two_engines_each_needing_more_than_half_the_budget_both_finish(preemption):
    """Both accepted (each held 224 of the 256 KiB before), both grow step by step; before the
    rule each then waited for the other's pages for ever (3,000 steps, 197 tokens each)."""
    clock = [0.0]
    budget = MemoryBudget(256 * KiB, idle_release_s=1.0, clock=lambda: clock[0])
    opts = dict(OPTS, max_context=512, max_batch=2, preemption=preemption,
                swap_bytes=1 << 20 if preemption == "swap" else 0)
    a = Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=224 * KiB,
               min_cache_bytes=32 * KiB, **opts)
    _idle_to_min(a, clock)
    b = Engine(model("tiny-qwen2"), memory_budget=budget, cache_bytes=224 * KiB,
               min_cache_bytes=32 * KiB, **opts)
    _idle_to_min(b, clock)
    assert a.cache_bytes == b.cache_bytes == 32 * KiB
    sp = SamplingParams(max_new_tokens=380, ignore_eos=True)      # 440 tokens: 220 KiB
    pa, pb = [(j * 7) % 250 + 1 for j in range(60)], [(j * 11) % 250 + 1 for j in range(60)]
    ra, rb = a.add_request(pa, sp), b.add_request(pb, sp)
    for _ in range(3000):
        if not (a.has_unfinished() or b.has_unfinished()):
            break
        a.step()
        b.step()
        assert a.cache_bytes + b.cache_bytes == budget.held_bytes <= budget.total_bytes
        clock[0] += 0.01
    assert (a.status(ra), b.status(rb)) == ("finished", "finished")
    assert tokens([a.output(ra)]) == hf_greedy("tiny-llama", [pa], 380, ignore_eos=True)
    assert tokens([b.output(rb)]) == hf_greedy("tiny-qwen2", [pb], 380, ignore_eos=True)
    assert budget.stats()["shares"][b.memory_share.name].yields >= 1
    a.close()
    b.close()


def test_a_busy_engine_yields_to_a_neighbour_that_cannot_run():
    """A has a queue all along (a steady stream); B's accepted request (208 tokens, B held 192
    KiB before) needs more than B's 64 KiB. Before the rule B waited while A served 36
    others, for as long as A's stream lasted."""
    clock = [0.0]
    budget = MemoryBudget(256 * KiB, idle_release_s=1.0, clock=lambda: clock[0])
    opts = dict(OPTS, max_context=256, max_batch=4)
    a = Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=64 * KiB,
               min_cache_bytes=64 * KiB, **opts)
    b = Engine(model("tiny-qwen2"), memory_budget=budget, cache_bytes=192 * KiB,
               min_cache_bytes=64 * KiB, **opts)
    _idle_to_min(b, clock)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for i in range(12):
        a.add_request([(i * 7 + j) % 250 + 1 for j in range(60)], sp)
    while a.cache_bytes < 192 * KiB:
        a.step()
    long = list(range(1, 201))
    rid = b.add_request(long, SamplingParams(max_new_tokens=8, ignore_eos=True))
    waited = 0
    for step in range(100):
        if len(a.scheduler.waiting) < 3:
            a.add_request([(step * 3 + j) % 250 + 1 for j in range(60)], sp)
        a.step()
        b.step()
        clock[0] += 0.05
        waited += b.status(rid) == "waiting"
        assert len(a.scheduler.waiting) >= 1          # A is never without a queue
    assert b.status(rid) == "finished" and waited <= 2
    assert tokens([b.output(rid)]) == hf_greedy("tiny-qwen2", [long], 8, ignore_eos=True)
    a.close()
    b.close()


def test_two_engine_threads_growing_at_once_stay_within_the_total():
    """Both decide before either resizes (a barrier): decide reserves what it grants, so the
    second gets only what the first left; the second settle raised ConfigError out of step()
    and the caches held 256 KiB of a 192 KiB budget."""
    budget = MemoryBudget(192 * KiB, idle_release_s=100.0)
    opts = dict(OPTS, max_context=256, max_batch=4)
    engines = [Engine(model(f), memory_budget=budget, cache_bytes=64 * KiB, **opts)
               for f in ("tiny-llama", "tiny-qwen2")]
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for e in engines:
        for i in range(4):
            e.add_request([(i * 5 + j) % 250 + 1 for j in range(100)], sp)
        e.step()
    barrier = threading.Barrier(2)
    for e in engines:
        decide = e.memory_share.decide

        def both_decided(*args, _decide=decide, **kwargs):
            target = _decide(*args, **kwargs)
            barrier.wait(timeout=30)
            return target
        e.memory_share.decide = both_decided
    errors = []

    def run(e):
        try:
            e.step()
        except Exception as error:       # noqa: BLE001 - the test reports it
            errors.append(error)
    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = sum(e.cache_bytes for e in engines)
    assert held == budget.held_bytes <= budget.total_bytes
    assert budget.stats()["unclaimed_bytes"] == budget.total_bytes - held
    for e in engines:
        del e.memory_share.decide
        e.run_until_done()
        e.close()


def _engine(budget, **kw):
    return Engine(model(), memory_budget=budget, page_bytes=4096, max_context=64, **kw)


def test_an_engine_dropped_without_close_or_failing_to_build_leaves_the_budget(monkeypatch):
    budget = MemoryBudget(256 * KiB)

    def use():
        e = _engine(budget, cache_bytes=192 * KiB)
        e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    use()
    gc.collect()
    assert budget.held_bytes == 0 and budget.stats()["shares"] == {}
    import vmemkv.runtime.engine.engine as engine_module
    from vmemkv.runtime.hf.attention import UnsupportedModelError

    def refuse(*args, **kwargs):
        raise UnsupportedModelError("failed the engine's self-check (as a model may)")
    monkeypatch.setattr(engine_module, "self_check", refuse)
    with pytest.raises(UnsupportedModelError):
        _engine(budget, cache_bytes=192 * KiB, self_check=True)
    assert budget.held_bytes == 0 and budget.stats()["shares"] == {}
    monkeypatch.undo()

    def interrupted(self, *args):
        raise KeyboardInterrupt          # Ctrl-C while the engine builds
    monkeypatch.setattr(Engine, "_build_rest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _engine(budget, cache_bytes=192 * KiB)
    assert budget.held_bytes == 0 and budget.stats()["shares"] == {}
    monkeypatch.undo()
    _engine(budget, cache_bytes=192 * KiB).close()        # the whole budget is there


def test_the_first_step_after_wake_does_not_grow_for_the_preemptions_sleep_made():
    """sleep() preempts the running request; rebalance_memory read that as 'the last step
    preempted' and grew 128 KiB -> 256 KiB for a request that fits 30 KiB."""
    sizes = {}
    prompt = [6] * 20
    for sleep in (False, True):
        budget = MemoryBudget(1024 * KiB, idle_release_s=100.0)
        e = Engine(model(), memory_budget=budget, cache_bytes=128 * KiB,
                   min_cache_bytes=64 * KiB, max_context=128, max_batch=4, **OPTS)
        rid = e.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        e.step()
        if sleep:
            e.sleep()
            e.wake()
            assert e.scheduler.metrics.num_preemptions == 1
        e.step()
        sizes[sleep] = (e.cache_bytes, budget.held_bytes)
        e.run_until_done()
        assert tokens([e.output(rid)]) == hf_greedy("tiny-llama", [prompt], 40, ignore_eos=True)
        e.close()
    assert sizes == {False: (128 * KiB, 128 * KiB), True: (128 * KiB, 128 * KiB)}


def test_min_cache_bytes_past_the_cache_or_its_max_or_without_a_budget_is_refused():
    """It was lowered to cache_bytes silently (min(low, cache_bytes)), and ignored without a
    budget."""
    budget = MemoryBudget(1024 * KiB)
    with pytest.raises(EngineConfigError, match=r"min_cache_bytes \(524288\) is above "
                                                r"cache_bytes \(65536\)"):
        _engine(budget, cache_bytes=64 * KiB, min_cache_bytes=512 * KiB)
    with pytest.raises(EngineConfigError, match=r"min_cache_bytes \(262144\) is above "
                                                r"max_cache_bytes \(131072\)"):
        _engine(budget, min_cache_bytes=256 * KiB, max_cache_bytes=128 * KiB)
    with pytest.raises(EngineConfigError, match=r"min_cache_bytes \(131072\) is above "
                                                r"cache_bytes \(65536\)"):   # from max_batch
        _engine(budget, max_batch=2, layout="per-layer", min_cache_bytes=128 * KiB)
    with pytest.raises(EngineConfigError, match=r"min_cache_bytes=4096 needs a memory_budget"):
        _engine(None, cache_bytes=64 * KiB, min_cache_bytes=4096)
    assert budget.held_bytes == 0


def _beam_engines(first_only: bool = False):
    """tiny-llama on a 64 KiB budget, 4 KiB pages per-layer (a page group: 16 KiB, 32 tokens);
    a neighbour reserving 16 KiB leaves it 48 KiB, though its max is the whole budget."""
    budget = MemoryBudget(64 * KiB, idle_release_s=0.0)
    opts = dict(page_bytes=4096, max_context=128, self_check=False, min_cache_bytes=16 * KiB)
    a = Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=32 * KiB, **opts)
    a.rebalance_memory()                                  # idle: down to its minimum
    make_b = lambda: Engine(model("tiny-qwen2"), memory_budget=budget,    # noqa: E731
                            cache_bytes=32 * KiB, **opts)
    return budget, a, (make_b if first_only else make_b())


def test_a_beam_group_past_what_the_neighbours_minimums_leave_is_refused_when_added():
    """3 beams over 32 tokens need 4 page groups (64 KiB) from their first decode; the share
    can reach 48. It was accepted (a growable pool skipped the check) and waited for ever,
    holding 48 KiB, and the neighbour starved beside it."""
    from vmemkv.runtime.engine import BeamSearchParams
    from vmemkv.runtime.engine.errors import RequestRejectedError
    budget, a, b = _beam_engines()
    assert a.scheduler.reach_bytes == 48 * KiB
    with pytest.raises(RequestRejectedError, match="the most its MemoryBudget share can hold"):
        a.add_beam_request(list(range(1, 33)), BeamSearchParams(3, max_new_tokens=4,
                                                                ignore_eos=True))
    assert not a.has_unfinished()
    rid = b.add_request(list(range(1, 41)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    for _ in range(50):
        if not b.has_unfinished():
            break
        a.step()
        b.step()
    assert b.output(rid).status == "finished" and len(b.output(rid).outputs[0].token_ids) == 10
    a.close()
    b.close()


def test_a_beam_group_the_reach_shrank_under_ends_failed_instead_of_waiting_for_ever():
    """Added while the engine had the budget alone (it fitted 64 KiB), then a neighbour
    registered with a 16 KiB minimum: the group can no longer grow by a token and ends
    'failed' by name; the neighbour's request runs."""
    from vmemkv.runtime.engine import BeamSearchParams
    budget, a, make_b = _beam_engines(first_only=True)
    rid = a.add_beam_request(list(range(1, 33)), BeamSearchParams(3, max_new_tokens=4,
                                                                  ignore_eos=True))
    b = make_b()
    for _ in range(200):
        if not a.has_unfinished():
            break
        a.step()
        b.rebalance_memory()
    out = a.output(rid)
    assert out.status == "failed" and out.error.type == "RequestTooLargeError", out.error
    assert a.scheduler.manager.stats().live_tokens == 0
    a.close()
    b.close()
