"""Recompute: a sequence part-way through its prefill is recomputed even when preemption is
by swap (free tells the manager how far it got, so only computed units are published), and
``recomputed_tokens`` (docs/simulation.md) counts the cached tokens recompute threw away: a
preempted sequence's, and what an ``n > 1`` sample forked into no room would have shared with
its parent (it waits and computes them again)."""
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = get_model("tiny")


def _step(sched):
    plan = sched.schedule()
    sampled = {s.seq_id: 1 for s in plan.seqs if s.sample}
    for s in plan.seqs:
        sampled.update({child: 2 for child in s.fork_ids})
    sched.update(sampled)


def test_a_sample_forked_into_no_room_counts_the_prompt_it_computes_again():
    mgr = make_manager("paged", TINY, 128 * TINY.bytes_per_token, 64, block_size_tokens=4)
    sched = Scheduler(mgr, SchedulerConfig(max_running=1))     # the second sample cannot run
    sched.add_request(Request(0, 8, 3, n=2))
    _step(sched)
    assert [sched.state_of(i) for i in (0, 1)] == [SeqState.RUNNING, SeqState.WAITING]
    assert sched.metrics.recomputed_tokens == 8
    assert sched.metrics.num_preemptions == 0


def test_a_sequence_preempted_part_way_through_its_prefill_is_recomputed_not_swapped():
    """Two tokens a step: B's 24-token prompt is held whole but computed one token a step; A's
    decode outgrows the 32-token cache at its 9th token and preempts B, the latest admitted."""
    mgr = make_manager("paged", TINY, 32 * TINY.bytes_per_token, 64, block_size_tokens=4,
                       swap_bytes=64 * TINY.bytes_per_token)
    sched = Scheduler(mgr, SchedulerConfig(max_running=2, max_tokens_per_step=2,
                                           preemption="swap", enable_prefix_sharing=True,
                                           check_every_step=True))
    sched.add_request(Request(0, 4, 20, prompt_token_ids=tuple(range(4))))
    sched.add_request(Request(1, 24, 2, prompt_token_ids=tuple(range(10, 34))))
    for _ in range(7):                  # A's 9th token: its third block
        _step(sched)
    assert sched.metrics.num_preemptions == 1
    assert sched.state_of(1) is SeqState.WAITING and sched.metrics.num_swap_preemptions == 0
    assert sched.metrics.recomputed_tokens == 4          # the part of B's prompt computed
