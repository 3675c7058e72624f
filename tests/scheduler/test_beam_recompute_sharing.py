"""A beam group preempted by recompute comes back sharing its history again (the prompt and the
outputs beams have in common, in whole units): its first member computes the group's common
history once, each other beam holds what it shares most with an earlier one and starts after
that is computed. Scripted groups whose beams share long histories in pairs (A, B after the
first token, each split in two after 12), beside a long request that preempts them, on a
paged pool of 4-token blocks."""
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


def pair_units(a, b) -> int:
    """Whole 4-token blocks two beams' histories (8 prompt tokens, then outputs) share, below
    each one's last token."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return min(8 + common, 8 + len(a) - 1) // 4


def assert_shares_its_tree(group) -> None:
    """Each beam after the first holds the blocks of the history it shares most with an
    earlier beam (at least the group's trunk), waits for them to be computed, and holds every
    other block alone: the group holds each block of its histories' tree once."""
    (outputs, _, first), *others = group
    assert len({len(o) for o, _, _ in group}) == 1     # beams decode in lockstep
    trunk = min(pair_units(outputs, o) for o, _, _ in others)
    assert trunk >= 2                                  # the prompt's two blocks at least
    distinct = len(first)
    for j, (out, computed, table) in enumerate(others, 1):
        units, parent = max((pair_units(group[i][0], out), -i) for i in range(j))
        assert units >= trunk and table[:units] == group[-parent][2][:units]
        earlier = {b for _, _, t in group[:j] for b in t}
        assert not set(table[units:]) & earlier and computed == 0   # its own; it waits
        distinct += len(table) - units
    assert len({b for _, _, t in group for b in t}) == distinct


@pytest.mark.parametrize("cache_tokens, other_prompt", [(96, 24), (96, 16), (88, 32)])
def test_a_recomputed_group_shares_its_history_again_and_finishes(cache_tokens, other_prompt):
    # as private copies (before) the group needs 28 blocks at 25 tokens, the pool has 22-24:
    # "cannot be admitted to an empty cache"
    sched, readmitted = run(cache_tokens, other_prompt)
    assert not sched.has_unfinished() and readmitted
    assert sched.manager.stats().live_tokens == 0
    for group in readmitted:
        assert_shares_its_tree(group)


def test_beams_that_shared_more_in_pairs_come_back_sharing_their_pairs_history():
    # 16 blocks: the group held 12 at 21 tokens (pairs sharing 12 outputs). With only the
    # common prompt shared again it needed 2 + 4 x 4 blocks and failed by name ("cannot be
    # admitted to an empty cache"); each pair's history shared, it needs the 12 it held
    sched, readmitted = run(64, 4)
    assert not sched.has_unfinished() and sched.manager.stats().live_tokens == 0
    (group,) = readmitted
    assert_shares_its_tree(group)
    outputs = [o for o, _, _ in group]
    assert sorted(pair_units(outputs[0], o) for o in outputs[1:]) == [2, 2, 5]   # a pair: 5


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
