"""A beam group preempted by recompute comes back sharing the history its beams have in common
(the prompt and their common outputs, in whole units): its first member computes it once,
the others are forked from it and start after it. Scripted groups whose beams share long
histories in pairs (A, B after the first token, each split in two after 12), beside a long
request that preempts them, on a paged pool of 4-token blocks."""
import pytest

from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.request import Request

from .test_scheduler_liveness import check_states, make_scheduler

SPLIT = 12   # outputs before each of the two beams splits in two


def _select(sched, plan) -> dict:
    """The beam search's decisions for the group's sampling step, and every token."""
    sampled = {s.seq_id: 5 for s in plan.seqs if s.sample}
    beams = [sched.seqs[s.seq_id] for s in plan.seqs if s.sample and sched.seqs[s.seq_id].beam_width]
    if beams and len(beams[0].output) in (0, SPLIT):
        for b in beams:       # A, B after the prompt; each in two after SPLIT outputs
            sampled[b.seq_id] = 1
            sampled[sched.branch(b.seq_id, 1)[0]] = 2
    return {i: (3 if i in {b.seq_id for b in beams} and len(beams[0].output) not in (0, SPLIT)
                else t) for i, t in sampled.items()}


def run(cache_tokens: int, other_prompt: int):
    """(the scheduler, [[(outputs, computed tokens, block table) of each beam] the step its
    group was admitted again, ...])."""
    sched = make_scheduler("paged", "per-layer", cache_tokens=cache_tokens, max_running=8,
                           max_tokens_per_step=64)
    sched.add_request(Request(0, other_prompt, 64 - other_prompt,
                              prompt_token_ids=[7] * other_prompt))
    sched.add_request(Request(1, 8, 20, prompt_token_ids=[1] * 8, beam_width=4))
    readmitted = []
    for _ in range(400):
        if not sched.has_unfinished():
            break
        waiting = {s.seq_id for s in sched.waiting}
        plan = sched.schedule()
        back = [s for s in sched.running if s.seq_id in waiting and s.request.request_id == 1]
        if len(back) > 1:
            readmitted.append([(tuple(s.output), s.num_computed,
                                tuple(sched.manager.block_table(s.seq_id))) for s in back])
        sched.update(_select(sched, plan))
        check_states(sched)
        for seq_id, seq in list(sched.seqs.items()):
            if seq.state.is_ended:
                sched.forget(seq_id)
    return sched, readmitted


@pytest.mark.parametrize("cache_tokens, other_prompt", [(96, 24), (96, 16), (88, 32)])
def test_a_recomputed_group_shares_its_history_again_and_finishes(cache_tokens, other_prompt):
    # as private copies (before) the group needs 28 blocks at 25 tokens, the pool has 22-24:
    # "cannot be admitted to an empty cache"
    sched, readmitted = run(cache_tokens, other_prompt)
    assert not sched.has_unfinished() and readmitted
    assert sched.manager.stats().live_tokens == 0
    for group in readmitted:
        (outputs, _, first), *others = group
        assert len({len(o) for o, _, _ in group}) == 1     # beams decode in lockstep
        common = next((i for i, col in enumerate(zip(*(o for o, _, _ in group)))
                       if len(set(col)) > 1), len(outputs))
        units = min(8 + common, 8 + len(outputs) - 1) // 4
        assert units >= 2                                  # the prompt's two blocks at least
        for _, computed, table in others:
            assert table[:units] == first[:units]          # the leader's blocks
            assert not set(table[units:]) & set(first) and computed == 0   # it waits
        assert len({b for _, _, t in group for b in t}) == units + sum(
            len(t) - units for _, _, t in group)


def test_a_group_that_cannot_come_back_even_sharing_fails_by_name():
    # 16 blocks: the group held 12 at 21 tokens (pairs sharing 12 outputs), comes back with
    # only the prompt shared: 2 + 4 x 4 blocks
    with pytest.raises(RequestTooLargeError, match="cannot be admitted to an empty cache") as e:
        run(64, 4)
    assert e.value.request_id == 1


def test_a_resize_that_leaves_a_beam_group_no_room_to_come_back_is_refused():
    """Checked per sequence, a shrink left 3 beams of 15 tokens a 24-token pool (each fits
    alone), and the group failed at its next admission (seen in a chaos run: 3 beams of 33
    tokens on a pool resized to 64). Now the group counts as it would come back: its common
    history once (the prompt's whole 8-token page), each beam's tail in whole pages."""
    from vmemkv.scheduler.errors import CacheResizeError
    sched = make_scheduler("vmem", "per-layer", cache_tokens=128, max_running=8)
    mgr, bpt = sched.manager, sched.manager.bytes_per_token
    sched.add_request(Request(0, 12, 10, prompt_token_ids=[1] * 12, beam_width=3))
    for step in range(3):                  # prompt, then 3 beams diverging at their first token
        plan = sched.schedule()
        beams = [sched.seqs[s.seq_id] for s in plan.seqs if s.sample]
        sampled = {b.seq_id: 3 for b in beams}
        if step == 0:
            sampled.update(zip(sched.branch(beams[0].seq_id, 2), (4, 5)))
        sched.update(sampled)
    members = [s for s in sched.seqs.values() if not s.state.is_ended]
    assert [s.length for s in members] == [15] * 3
    assert sched.group_floor_tokens(members) == 8 + 3 * 8
    for tokens, refused in ((24, True), (32, False)):
        before = (mgr.cache_bytes, [(s.state, s.held) for s in members])
        sched.begin()
        mgr.begin()
        try:
            sched.resize(tokens * bpt, preempt=True)
        except CacheResizeError as error:
            assert refused and "beam search request 0 (3 beams of 15 tokens) needs 32 tokens" \
                in str(error)
            mgr.rollback()
            sched.rollback()
            assert (mgr.cache_bytes, [(s.state, s.held) for s in members]) == before
        else:
            assert not refused and mgr.cache_bytes == 32 * bpt
            mgr.commit()
            sched.commit()


def test_a_recomputed_sample_holds_its_running_siblings_prompt_instead_of_a_copy():
    """n = 3 samples beside a long request on a small paged pool: a sample preempted (by
    recompute) comes back holding a running sibling's blocks of their prompt (16 tokens, 4
    blocks) and computes only its own outputs; before, it took and recomputed its own copy
    of the prompt. Its outputs differ from the siblings' from the first token on."""
    sched = make_scheduler("paged", "per-layer", cache_tokens=72, max_running=8,
                           max_tokens_per_step=64)
    sched.add_request(Request(0, 40, 24, prompt_token_ids=[7] * 40))
    sched.add_request(Request(1, 16, 24, n=3, prompt_token_ids=list(range(16))))
    readmitted = []
    for _ in range(300):
        if not sched.has_unfinished():
            break
        waiting = {s.seq_id for s in sched.waiting if s.output}
        plan = sched.schedule()
        for s in sched.running:
            if s.seq_id in waiting:
                siblings = [r for r in sched.running if r.request is s.request and r is not s
                            and r.seq_id not in waiting]
                readmitted.append((s.num_computed, sched.manager.block_table(s.seq_id)[:4],
                                   [sched.manager.block_table(r.seq_id)[:4] for r in siblings]))
        sched.update({s.seq_id: 1 + s.seq_id % 5 for s in plan.seqs if s.sample})
        check_states(sched)
        for seq_id, seq in list(sched.seqs.items()):
            if seq.state.is_ended:
                sched.forget(seq_id)
    assert not sched.has_unfinished() and sched.manager.stats().live_tokens == 0
    shared = [r for r in readmitted if r[2]]      # (those with no sibling running: a copy)
    assert len(shared) >= 2, readmitted
    for computed, first, siblings in shared:
        assert computed == 16 and first in siblings
