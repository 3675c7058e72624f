"""A request aborted between ``schedule()`` and ``update()`` (a client gone while its step
runs): ``update`` records nothing of it, as ``prune`` drops a pruned beam's step, and every
other request goes on. Before, ``update`` appended the aborted sequence's token and, at its
last token, raised KeyError from ``_finish`` (or, with prefix sharing, UnknownSequenceError
from ``mark_computed`` for an aborted prefill chunk) after changing part of the state."""
import pytest

from vmemkv.scheduler.managers import POLICIES, make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token


def _scheduler(policy, **config):
    manager = make_manager(policy, TINY, 2 * 32, 16, block_size_tokens=4, page_bytes=4,
                           max_slots=4)
    return Scheduler(manager, SchedulerConfig(check_every_step=True, **config))


def _run_out(sched):
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update({s.seq_id: 7 for s in plan.seqs if s.sample})


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_aborted_mid_step_records_no_token_and_the_other_finishes(policy):
    sched = _scheduler(policy)
    sched.add_request(Request(0, 3, 2))                 # its next decode is its last token
    sched.add_request(Request(1, 3, 4))
    plan = sched.schedule()
    sched.update({s.seq_id: 5 for s in plan.seqs})      # both prefilled: one token each
    plan = sched.schedule()
    assert [s.seq_id for s in plan.seqs] == [0, 1]
    assert sched.abort_request(0) == [0]
    assert sched.update({0: 6, 1: 6}) == [0]            # ended: in the next plan.finished
    assert sched.state_of(0) is SeqState.ABORTED
    assert sched.seqs[0].output == [5]                  # the aborted step's token is dropped
    assert sched.seqs[1].output == [5, 6]
    assert sched.metrics.num_aborted_requests == 1
    assert sched.metrics.num_finished_requests == 0
    _run_out(sched)
    assert sched.seqs[1].output == [5, 6, 7, 7] and sched.state_of(1) is SeqState.FINISHED
    assert sched.metrics.num_finished_requests == 1
    assert sched.manager.stats().live_tokens == 0
    sched.manager.check_idle()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefill_chunk_aborted_mid_step_records_nothing_and_the_other_finishes(policy):
    sched = _scheduler(policy, max_running=2, max_tokens_per_step=5, enable_prefix_sharing=True)
    prompt = tuple(range(12))
    sched.add_request(Request(0, 12, 2, prompt_token_ids=prompt))
    sched.add_request(Request(1, 12, 2, prompt_token_ids=prompt))
    plan = sched.schedule()
    assert [(s.seq_id, s.num_new_tokens, s.sample) for s in plan.seqs] == [(0, 5, False)]
    assert sched.abort_request(0) == [0]
    assert sched.update({}) == [0]
    assert sched.state_of(0) is SeqState.ABORTED and sched.seqs[0].num_computed == 0
    _run_out(sched)
    assert sched.state_of(1) is SeqState.FINISHED and sched.seqs[1].output == [7, 7]
    assert sched.metrics.num_aborted_requests == 1
    assert sched.metrics.num_finished_requests == 1
    sched.manager.check_idle()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_finished_mid_step_records_no_token_and_the_other_finishes(policy):
    # finish() (the engine's stop strings) between schedule and update at the last token:
    # update raised KeyError from _finish, the request's count already gone
    sched = _scheduler(policy)
    sched.add_request(Request(0, 3, 2))
    sched.add_request(Request(1, 3, 4))
    plan = sched.schedule()
    sched.update({s.seq_id: 5 for s in plan.seqs})
    sched.schedule()
    sched.finish(0)
    sched.update({0: 6, 1: 6})
    assert sched.state_of(0) is SeqState.FINISHED and sched.seqs[0].output == [5]
    _run_out(sched)
    assert sched.seqs[1].output == [5, 6, 7, 7] and sched.manager.stats().live_tokens == 0
