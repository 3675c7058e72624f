"""A single request's length on an engine a MemoryBudget resizes is judged against its reach
(the share's max, less the other shares' minimums; scheduler/pool_reach.py), as a beam group's
is: one longer than the pool has held so far runs while the pool grows on demand (it was
refused as "can never fit" against the 32 tokens the 16 KiB pool held), one past the reach is
refused naming it, "can never fit" is kept for one past the share's max, and one the reach
shrinks under ends failed by name, as a beam group does. The server's advertised limits follow.

tiny-llama, 4 KiB pages interleaved: 512 bytes a token, so 16 KiB hold 32 tokens, 128 KiB 256
and the 256 KiB max 512."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.scheduler.budget import MemoryBudget

from .conftest import model

KiB = 1024
OPTS = dict(page_bytes=4096, layout="interleaved", max_batch=4)


def _budgeted(total_kib: int, max_context: int = 512) -> Engine:
    budget = MemoryBudget(total_kib * KiB, clock=lambda: 0.0)
    return Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=16 * KiB,
                  max_cache_bytes=256 * KiB, max_context=max_context, **OPTS)


def _run(engine: Engine, prompt, params) -> tuple:
    return _run_to_end(engine, engine.add_request(prompt, params))


def _run_to_end(engine: Engine, rid: int) -> tuple:
    """(status, error, token ids) of request ``rid`` once the engine has run out of work."""
    for _ in range(300):
        if not engine.has_unfinished():
            break
        engine.step()
    out = engine.output(rid)
    return out.status, out.error, out.outputs[0].token_ids


def test_a_request_longer_than_the_pool_has_held_runs_as_it_grows_to_its_reach():
    """108 tokens on a 16 KiB pool (32 tokens) with 256 KiB in reach: accepted, the pool
    grows, and the tokens are those of an engine built at 256 KiB without a budget."""
    prompt, params = [(j * 7) % 250 + 1 for j in range(100)], \
        SamplingParams(max_new_tokens=8, ignore_eos=True)
    with _budgeted(1024) as engine:
        assert (engine.scheduler.max_fit_tokens, engine.scheduler.max_fit_tokens_at_max) == \
            (32, 512)
        status, error, got = _run(engine, prompt, params)
        assert (status, error) == ("finished", None)
        assert 16 * KiB < engine.cache_bytes <= 256 * KiB
    with Engine(model("tiny-llama"), cache_bytes=256 * KiB, max_context=512, **OPTS) as fixed:
        assert _run(fixed, prompt, params) == ("finished", None, got)
    assert len(got) == 8


def test_a_request_past_what_the_neighbours_minimums_leave_is_refused_naming_the_reach():
    """A neighbour reserving 192 KiB of 320 leaves 128 KiB (256 tokens): 300 tokens are refused
    naming that reach and the max (512 tokens), nothing changes; 600 are past the max: "can
    never fit"; 200 are accepted."""
    with _budgeted(320, max_context=1024) as engine:
        budget = engine.memory_share.budget
        budget.register("neighbour", 192 * KiB, 192 * KiB)
        assert engine.scheduler.reach_bytes == 128 * KiB
        held, gauges = budget.held_bytes, engine.scheduler.gauges()
        with pytest.raises(RequestRejectedError, match=(
                r"292 prompt \+ 8 new tokens = 300 tokens do not fit the 256 tokens of one "
                r"sequence its cache holds grown to the 131072 bytes its MemoryBudget share can "
                r"reach now \(the budget's 327680 less the other shares' minimums; at its max, "
                r"262144 bytes, it would hold 512\)")):
            engine.add_request([5] * 292, SamplingParams(max_new_tokens=8, ignore_eos=True))
        with pytest.raises(RequestRejectedError, match=r"600 tokens can never fit; the cache "
                                                       r"holds 512 tokens of one sequence"):
            engine.add_request([5] * 592, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert not engine.has_unfinished()
        assert (budget.held_bytes, engine.cache_bytes) == (held, 16 * KiB)
        assert engine.scheduler.gauges() == gauges
        status, error, got = _run(engine, [5] * 192, SamplingParams(max_new_tokens=8,
                                                                    ignore_eos=True))
        assert (status, error, len(got)) == ("finished", None, 8)


@pytest.mark.parametrize("steps_first", [0, 3])
def test_a_request_the_reach_shrank_under_ends_failed_by_name_as_a_beam_group_does(steps_first):
    """400 tokens accepted with 256 KiB in reach (waiting, or running after 3 steps); then a
    neighbour reserves 192 KiB of 320, leaving 128 KiB (256 tokens): the request runs until it
    cannot grow past 256 tokens and ends failed, RequestTooLargeError naming its sequence,
    holding nothing (it does not wait for ever)."""
    with _budgeted(320, max_context=1024) as engine:
        rid = engine.add_request([5] * 100, SamplingParams(max_new_tokens=300, ignore_eos=True))
        for _ in range(steps_first):
            engine.step()
        engine.memory_share.budget.register("neighbour", 192 * KiB, 192 * KiB)
        for _ in range(300):
            if not engine.has_unfinished():
                break
            engine.step()
        out = engine.output(rid)
        assert (out.status, out.error.type) == ("failed", "RequestTooLargeError")
        assert "sequence 0 (257 tokens) cannot grow in a cache of 256 tokens" in out.error.message
        assert len(out.outputs[0].token_ids) == 157
        assert engine.scheduler.manager.stats().live_tokens == 0


def test_the_servers_limits_follow_the_reach_of_a_budgeted_engine():
    """/v1/models' max_model_len and the per-request limit (past it: 400) are the tokens at
    the reach, read when asked: 512 alone (it advertised the 32 the pool held), 256 once a
    neighbour reserves 192 KiB of 320."""
    with _budgeted(320, max_context=1024) as engine:
        served = ServedModel.of(engine, "tiny-llama")
        assert (served.model_limit(), served.limit_for(100)) == (512, 512)
        engine.memory_share.budget.register("neighbour", 192 * KiB, 192 * KiB)
        assert (served.model_limit(), served.limit_for(100)) == (256, 256)
