"""What ``update``, ``finish`` and ``withdraw_request`` record for requests ended part-way.

A request aborted between ``schedule()`` and ``update()`` has its step's token dropped; before,
``generated_tokens`` still counted it (and its n > 1 children's), so the counter exceeded the
tokens any sequence holds. ``finish`` of an n > 1 sample before its first token ended it with
its children never forked: the request stayed unfinished for ever (never counted finished, its
id refused as "already queued"); it is refused, nothing changed. ``withdraw_request`` of a
request reusing an ended (not forgotten) request's id was refused as if a step had seen it."""
import pytest

from vmemkv.scheduler.errors import SchedulerError
from vmemkv.scheduler.lifecycle import withdraw_request
from vmemkv.scheduler.managers import POLICIES, make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token


def _scheduler(policy, **config):
    manager = make_manager(policy, TINY, 2 * 64, 16, block_size_tokens=4, page_bytes=4,
                           max_slots=4)
    return Scheduler(manager, SchedulerConfig(check_every_step=True, **config))


def _tokens_held(sched) -> int:
    return sum(len(seq.output) for seq in sched.seqs.values())


@pytest.mark.parametrize("policy", POLICIES)
def test_generated_tokens_leave_out_a_decode_aborted_mid_step(policy):
    sched = _scheduler(policy)
    sched.add_request(Request(0, 3, 4))
    sched.add_request(Request(1, 3, 4))
    plan = sched.schedule()
    sched.update({s.seq_id: 5 for s in plan.seqs})        # both prefilled: 2 tokens
    sched.schedule()
    sched.abort_request(0)
    sched.update({0: 6, 1: 6})                            # 0's token is dropped
    assert sched.seqs[0].output == [5] and sched.seqs[1].output == [5, 6]
    assert sched.metrics.generated_tokens == 3 == _tokens_held(sched)


@pytest.mark.parametrize("policy", POLICIES)
def test_generated_tokens_leave_out_an_aborted_prefill_and_its_forks(policy):
    sched = _scheduler(policy)
    sched.add_request(Request(0, 3, 4, n=3))              # samples 0, 1, 2
    sched.add_request(Request(1, 3, 4))                   # sample 3
    plan = sched.schedule()
    assert [(s.seq_id, s.fork_ids) for s in plan.seqs] == [(0, (1, 2)), (3, ())]
    sched.abort_request(0)
    sched.update({0: 5, 1: 5, 2: 5, 3: 5})                # only 3's token is kept
    assert sched.metrics.generated_tokens == 1 == _tokens_held(sched)
    assert sorted(sched.seqs) == [0, 3]                   # no child was forked


@pytest.mark.parametrize("policy", POLICIES)
def test_finish_before_the_forks_is_refused_and_changes_nothing(policy):
    sched = _scheduler(policy, max_tokens_per_step=4, max_running=4)
    sched.add_request(Request(0, 8, 3, n=3))
    sched.schedule()
    sched.update({})                                      # half the prompt: nothing sampled
    with pytest.raises(SchedulerError, match="sequence 0 has 2 pending forks"):
        sched.finish(0)
    assert sched.state_of(0) is SeqState.RUNNING
    while sched.has_unfinished():                         # it goes on: all three samples end
        plan = sched.schedule()
        sampled = {s.seq_id: 5 for s in plan.seqs if s.sample}
        sampled.update({c: 6 for s in plan.seqs for c in s.fork_ids})
        sched.update(sampled)
    assert sched.metrics.num_finished_requests == 1
    assert sched.metrics.generated_tokens == 9 == _tokens_held(sched)   # 3 samples, 3 tokens
    assert [sched.state_of(i) for i in range(3)] == [SeqState.FINISHED] * 3
    sched.add_request(Request(0, 8, 3))                   # its id is free again


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_reusing_an_ended_ones_id_can_be_withdrawn(policy):
    # add_request takes the id of an ended request again; withdrawing the new one counted the
    # ended one's sequence (not waiting): "only a request no step has scheduled can"
    sched = _scheduler(policy)
    sched.add_request(Request(5, 3, 1))
    plan = sched.schedule()
    sched.update({s.seq_id: 1 for s in plan.seqs})        # ended, not forgotten
    assert sched.add_request(Request(5, 3, 2)) == [1]
    withdraw_request(sched, 5)
    assert sorted(sched.seqs) == [0] and sched.state_of(0) is SeqState.FINISHED
    assert not sched.has_unfinished()
    assert sched.add_request(Request(5, 3, 2)) == [2]     # queued again: nothing was left
