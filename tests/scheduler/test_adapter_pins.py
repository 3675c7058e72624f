"""LoRA adapters in the scheduler (issue 31): every way a sequence ends (finish, abort,
preemption by recompute or swap, a rolled-back step) gives its adapter's pin back, so each
adapter's uses are exactly its running sequences after every schedule and update."""
import random

import pytest

from vmemkv.scheduler.errors import OutOfCapacityError
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import POLICIES, TINY, check_pins, manager, ref


ADAPTERS = [ref("a", "a1", 6 * TINY.bytes_per_token), ref("a", "a2", 10 * TINY.bytes_per_token),
            ref("b", "b", 3 * TINY.bytes_per_token), None]


@pytest.mark.parametrize("policy,layout", POLICIES)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pins_follow_running_sequences_through_every_ending(policy, layout, preemption, seed):
    """A tight cache, n > 1, beams, preemption, aborts and rolled-back steps: after every
    schedule and update each adapter's uses are its running sequences; at the end none."""
    preemptions, swaps, loads, evictions = drive_mixed(policy, layout, preemption, seed)
    assert preemptions and loads > 3 and evictions
    assert swaps if preemption == "swap" else not swaps


def drive_mixed(policy, layout, preemption, seed):
    rng = random.Random(seed)
    mgr = manager(policy, layout, tokens=96, swap_tokens=48, prefix_eviction="lru")
    sched = Scheduler(mgr, SchedulerConfig(preemption=preemption, enable_prefix_sharing=True,
                                           check_every_step=True, max_running=6))
    requests = []
    for i in range(24):
        adapter = ADAPTERS[rng.randrange(len(ADAPTERS))]
        prompt = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(2, 20)))
        beam = 2 if i % 7 == 3 else 0
        requests.append(Request(i, len(prompt), rng.randrange(1, 24), prompt_token_ids=prompt,
                                n=1 if beam else 1 + (i % 3 == 0), beam_width=beam,
                                adapter=adapter))
    pending = list(requests)
    for _ in range(3000):
        while pending and rng.random() < 0.4:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        rollback = rng.random() < 0.15
        if rollback:
            sched.begin()
            mgr.begin()
        plan = sched.schedule()
        check_pins(sched)
        for s in plan.seqs:
            seq = sched.seqs[s.seq_id]
            assert s.adapter_id == (None if seq.request.adapter is None
                                    else seq.request.adapter.digest)
        sampled = {s.seq_id: rng.randrange(1, 4) for s in plan.seqs if s.sample}
        for s in plan.seqs:
            sampled.update({c: rng.randrange(1, 4) for c in s.fork_ids})
        for s in plan.seqs:            # beams: grow each group to its width, prune sometimes
            seq = sched.seqs[s.seq_id]
            if seq.beam_width and s.sample and not seq.pending_forks:
                live = [q for q in sched.running if q.request is seq.request]
                if len(live) < seq.beam_width:
                    for child in sched.branch(seq.seq_id, 1):
                        sampled[child] = rng.randrange(1, 4)
                elif len(live) > 1 and rng.random() < 0.2:
                    sched.prune([seq.seq_id])
                    sampled.pop(seq.seq_id, None)
        sched.update(sampled)
        check_pins(sched)
        if rollback:
            mgr.rollback()
            sched.rollback()
            mgr.take_ops()
            check_pins(sched)
        elif rng.random() < 0.05:
            live = sorted({q.request.request_id for q in sched.seqs.values()
                           if not q.state.is_ended})
            if live:
                sched.abort_request(rng.choice(live))
                check_pins(sched)
    else:
        raise AssertionError("not finished")
    assert all(mgr.adapter_uses(a) == 0 for a in ADAPTERS if a is not None)
    assert mgr.adapter_stats().pinned == 0
    mgr.check_integrity()
    stats = mgr.adapter_stats()
    return sched.metrics.num_preemptions, sched.metrics.num_swap_preemptions, stats.loads, \
        stats.evictions


def test_a_swapped_out_sequence_does_not_pin_its_adapter():
    mgr = manager("paged", tokens=64, swap_tokens=64)
    adapter = ref("a", "a", 8 * TINY.bytes_per_token)
    sched = Scheduler(mgr, SchedulerConfig(preemption="swap", check_every_step=True))
    sched.add_request(Request(0, 4, 40))
    sched.add_request(Request(1, 4, 40, adapter=adapter))     # admitted last: the victim
    swapped_idle = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
        check_pins(sched)
        if sched.swapped and sched.swapped[0].request.adapter is adapter:
            assert mgr.adapter_uses(adapter) == 0
            swapped_idle = True
    assert swapped_idle, "the adapter's sequence was never swapped out"
    assert sched.state_of(1) is SeqState.FINISHED and sched.metrics.num_swap_preemptions
    assert mgr.adapter_stats().loads >= 1 and mgr.adapter_uses(adapter) == 0


def test_an_admission_refused_after_its_adapter_was_pinned_gives_the_pin_back():
    """Both or neither: a manager whose room estimate was optimistic refuses the allocation
    after ``acquire_adapter`` pinned the adapter; the request waits and pins nothing."""
    mgr = manager("paged", tokens=64)
    adapter = ref("a", "a", 8 * TINY.bytes_per_token)
    allocate = mgr.allocate

    def refuse_sequence_1(seq_id, *args, **kw):
        if seq_id == 1:
            raise OutOfCapacityError("no room after all (a test manager)")
        return allocate(seq_id, *args, **kw)

    mgr.allocate = refuse_sequence_1
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request(0, 4, 4))
    sched.add_request(Request(1, 4, 4, adapter=adapter))
    plan = sched.schedule()
    assert [s.seq_id for s in plan.seqs] == [0] and sched.state_of(1) is SeqState.WAITING
    assert mgr.adapter_uses(adapter) == 0 and mgr.adapter_stats().pinned == 0
