"""A beam group swapped back in holds each beam's own copy of the history the beams share. When,
with the cache to itself, it cannot grow by a token, it is recomputed (its beams share that
history again) instead of failing; only a group that, recomputed and shared, still cannot grow
fails, by name, and it is recomputed for it once. A scripted group of 4 beams (a 12-token
prompt, 4 different first tokens) beside an older 32-token request on a 48-token paged pool of
4-token blocks: the older one's growth swaps the group out while each beam holds 12 tokens; it
comes back privately into all 12 blocks, and its 13th tokens need 4 more."""
from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.request import Request, SeqState

from .test_scheduler_liveness import check_states, make_scheduler


def run(beam_new_tokens: int):
    """(the scheduler, the group's states each step, the error that failed it or None)."""
    sched = make_scheduler("paged", "per-layer", cache_tokens=48, swap_tokens=256,
                           max_running=8, max_tokens_per_step=64, preemption="swap")
    mgr = sched.manager
    sched.add_request(Request(0, 32, 3, prompt_token_ids=[7] * 32))
    sched.add_request(Request(1, 12, beam_new_tokens, prompt_token_ids=[1] * 12, beam_width=4))
    states, error = [], None
    for _ in range(60):
        if not sched.has_unfinished():
            break
        sched.begin()
        mgr.begin()
        try:
            plan = sched.schedule()
        except RequestTooLargeError as failed:     # what the engine does: the step is undone
            mgr.rollback()
            sched.rollback()
            error = failed
            sched.abort_request(failed.request_id, SeqState.FAILED)
            continue
        states.append(tuple(sorted({s.state.value for s in sched.seqs.values()
                                    if s.request.request_id == 1})))
        sampled = {s.seq_id: 7 for s in plan.seqs if s.sample}
        for s in plan.seqs:
            beam = sched.seqs[s.seq_id]
            if s.sample and beam.beam_width:
                sampled[s.seq_id] = 5 if beam.output else 1
                if not beam.output:      # 4 beams after the prompt, one token each
                    sampled.update(zip(sched.branch(s.seq_id, 3), (2, 3, 4)))
        sched.update(sampled)
        sched.commit()
        mgr.commit()
        check_states(sched)
        for seq_id, seq in list(sched.seqs.items()):
            if seq.state.is_ended:
                sched.forget(seq_id)
    assert not sched.has_unfinished() and mgr.stats().live_tokens == 0
    return sched, states, error


def test_a_group_swapped_in_that_cannot_grow_alone_is_recomputed_sharing_and_finishes():
    sched, states, error = run(4)
    assert error is None                 # it had failed: 'cannot grow in a cache of 48 tokens'
    assert states[1:5] == [("swapped",), ("swapped",), ("running",), ("waiting",)]
    m = sched.metrics
    assert (m.num_preemptions, m.num_swap_preemptions) == (8, 4)   # swapped once, recomputed once
    assert (m.num_finished_requests, m.num_failed_requests) == (2, 0)


def test_a_group_that_recomputed_and_shared_still_cannot_grow_fails_by_name_once():
    # shared, the 4 beams need 3 + 4 * 3 = 15 blocks at 21 tokens: recomputed once, then failed
    sched, states, error = run(12)
    assert isinstance(error, RequestTooLargeError) and error.request_id == 1
    assert "sequence 2 (21 tokens, one of the 4 beams of a beam search, which hold a unit each " \
        "and run together) cannot grow in a cache of 48 tokens" in str(error)
    assert states.count(("waiting",)) == 1
    m = sched.metrics
    assert (m.num_preemptions, m.num_swap_preemptions, m.num_failed_requests) == (8, 4, 1)
