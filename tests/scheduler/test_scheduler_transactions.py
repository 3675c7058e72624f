"""The scheduler's own transaction (begin / commit / rollback over queues, sequence states and
counters) and abort_request, against real managers: a step scheduled and rolled back leaves
no trace, so a run that rolls every step back once before committing it is identical to a run
without transactions; aborting any request at any point ends it, frees its memory and lets
every other request finish."""
import random

import pytest

from vmemkv.scheduler.errors import SchedulerError, UnknownRequestError
from vmemkv.scheduler.request import Request, SeqState

from .test_scheduler_liveness import POLICIES, check_states, make_scheduler


def scheduler_state(sched) -> tuple:
    """Everything observable of a scheduler and its manager through public accessors."""
    m = sched.metrics
    queues = tuple(tuple(s.seq_id for s in q) for q in (sched.waiting, sched.running, sched.swapped))
    seqs = {i: (s.state, s.num_computed, s.held, s.admit_order, tuple(s.output))
            for i, s in sched.seqs.items()}
    counters = (m.num_preemptions, m.num_swap_preemptions, m.recomputed_tokens, m.generated_tokens,
                m.num_finished_requests, m.num_aborted_requests, sched.has_unfinished())
    held = {s.seq_id: sched.manager.num_tokens(s.seq_id) for s in sched.running}
    return queues, seqs, counters, held, sched.manager.stats(), sched.gauges()


def submit(sched, rng, count, vocab=3):
    for rid in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        sched.add_request(Request(rid, len(prompt), rng.randint(1, 20), prompt_token_ids=prompt,
                                  n=rng.choice([1, 1, 2])))


def run(sched, rng, rollback_first: bool) -> list:
    """Run to the end; with ``rollback_first`` every step is scheduled and rolled back once
    (the state must be exactly as before) before it is scheduled for real."""
    trace = []
    while sched.has_unfinished():
        if rollback_first:
            before = scheduler_state(sched)
            sched.begin()
            sched.manager.begin()
            sched.schedule()
            sched.manager.rollback()
            sched.rollback()        # ops pending from update() (forks) are pending again
            assert scheduler_state(sched) == before
        sched.begin()
        plan = sched.schedule()
        sched.commit()
        sampled = {i: rng.randrange(3) for s in plan.seqs if s.sample for i in (s.seq_id,) + s.fork_ids}
        trace.append((plan.seqs, plan.ops, sched.update(sampled)))
        check_states(sched)
    return trace


@pytest.mark.parametrize("policy,layout", POLICIES)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_rolled_back_step_leaves_no_trace(policy, layout, preemption):
    runs = []
    for rollback_first in (False, True):
        sched = make_scheduler(policy, layout, preemption=preemption, enable_prefix_sharing=True,
                               max_running=6, max_tokens_per_step=24)
        submit(sched, random.Random(5), 12)
        runs.append(run(sched, random.Random(6), rollback_first))
        assert sched.manager.stats().live_tokens == 0
    assert runs[0] == runs[1]


def outcome(sched) -> dict:
    return {i: (s.state, tuple(s.output)) for i, s in sched.seqs.items()}


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_a_rolled_back_update_leaves_no_trace_and_the_step_runs_again(policy, layout):
    """``update`` (tokens appended, sequences finished and forked, prefixes published) inside a
    transaction, rolled back, leaves scheduler and manager exactly as after ``schedule``; the
    step is then scheduled again with the same work, and the run ends as one without it."""
    ends = []
    for roll_back in (False, True):
        sched = make_scheduler(policy, layout, enable_prefix_sharing=True, max_running=6,
                               max_tokens_per_step=24)
        submit(sched, random.Random(7), 10)
        rng = random.Random(8)
        while sched.has_unfinished():
            sched.begin()
            plan = sched.schedule()
            sched.commit()
            sampled = {i: rng.randrange(3) for s in plan.seqs if s.sample
                       for i in (s.seq_id,) + s.fork_ids}
            if roll_back and plan.seqs:
                before = scheduler_state(sched)
                sched.begin()
                sched.manager.begin()
                sched.update(sampled)
                sched.manager.rollback()
                sched.rollback()
                assert scheduler_state(sched) == before
                sched.begin()
                again = sched.schedule()
                sched.commit()
                assert again.seqs == plan.seqs
            sched.update(sampled)
            check_states(sched)
        assert sched.manager.stats().live_tokens == 0
        ends.append(outcome(sched))
    assert ends[0] == ends[1]


def test_transaction_api_contract():
    sched = make_scheduler("paged", "per-layer")
    with pytest.raises(SchedulerError, match="without begin"):
        sched.commit()
    with pytest.raises(SchedulerError, match="without begin"):
        sched.rollback()
    sched.begin()
    with pytest.raises(SchedulerError, match="inside an open transaction"):
        sched.begin()
    sched.commit()


@pytest.mark.parametrize("policy,layout", POLICIES)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_abort_at_random_points_ends_requests_and_frees_everything(policy, layout, preemption):
    rng = random.Random(7)
    sched = make_scheduler(policy, layout, preemption=preemption, enable_prefix_sharing=True,
                           max_running=6, max_tokens_per_step=24)
    submit(sched, rng, 16)
    assert sched.abort_request(15) and sched.state_of(max(sched.seqs)) is SeqState.ABORTED  # waiting
    aborted, states = {15}, {SeqState.WAITING}
    while sched.has_unfinished():
        live = sorted({s.request.request_id for s in sched.seqs.values() if not s.state.is_ended})
        if live and rng.random() < 0.15:
            rid = rng.choice(live)
            states |= {s.state for s in sched.seqs.values() if s.request.request_id == rid}
            ended = sched.abort_request(rid)
            assert ended and all(sched.state_of(i) is SeqState.ABORTED for i in ended)
            aborted.add(rid)
            sched.manager.check_integrity()
            continue
        plan = sched.schedule()
        sched.update({i: rng.randrange(3) for s in plan.seqs if s.sample for i in (s.seq_id,) + s.fork_ids})
    assert sched.metrics.num_aborted_requests == len(aborted)
    assert sched.metrics.num_finished_requests == 16 - len(aborted)
    assert {s.state for s in sched.seqs.values()} <= {SeqState.FINISHED, SeqState.ABORTED}
    assert sched.manager.stats().live_tokens == 0 and sched.manager.swap_free_bytes == sched.manager.swap_bytes
    assert SeqState.RUNNING in states
    with pytest.raises(UnknownRequestError, match=f"request {min(aborted)}"):
        sched.abort_request(min(aborted))
