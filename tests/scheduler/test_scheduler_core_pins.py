"""Scheduler core promises the broader tests did not pin (a mutation audit's survivors), one
property per test: a whole-prompt prefix hit still computes its last token; a plan's token sums;
swapped sequences come back oldest first, up to max_running, never in a step that preempted;
ending a request (reported, its adapter released, a swapped one too); the limits at their
edges (max_seq_len, a resize, beam width, max_running with forked beams); a rollback's latency
samples and starved flag; the gauges."""
import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import (CacheResizeError, CacheShrunkError, DuplicateSequenceError,
                                     RequestTooLargeError)
from vmemkv.scheduler.managers import PagedManager
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from tests.scheduler import adapter_sched
from tests.scheduler.test_adapter_elastic import resize
from tests.scheduler.test_scheduler_limits import (MAX_LEN, TINY, drain, make,
                                                    preempting_scheduler, step)


def _context_tokens(plan) -> int:
    return sum(s.num_computed_tokens + s.num_new_tokens for s in plan.seqs)


class WholePromptHits(PagedManager):
    """A policy whose prefix cache hits a whole prompt (``allocate``'s contract allows a hit
    of every token; the built-in managers stop one short)."""

    def allocate(self, seq_id, num_tokens, token_ids=None, *args, lookup=True, **kw):
        super().allocate(seq_id, num_tokens, token_ids, *args, lookup=lookup, **kw)
        return num_tokens if token_ids is not None and lookup else 0


def test_a_whole_prompt_prefix_hit_still_computes_and_samples_its_last_token():
    mgr = WholePromptHits(TINY, 128 * TINY.bytes_per_token, MAX_LEN, block_size_tokens=4)
    sched = Scheduler(mgr, SchedulerConfig(enable_prefix_sharing=True, max_running=8))
    sched.add_request(Request(0, 32, 2, prompt_token_ids=list(range(1, 33))))
    plans = drain(sched, limit=10)
    first = plans[0].seqs[0]
    assert (first.num_computed_tokens, first.num_new_tokens, first.sample) == (31, 1, True)
    assert sched.metrics.num_finished_requests == 1 and len(sched.seqs[0].output) == 2


def test_every_plans_context_tokens_sum_what_its_sequences_read():
    sched = make(max_tokens_per_step=16, max_running=4)
    sched.add_request(Request(0, 4, 6))
    sched.add_request(Request(1, 30, 3))
    plans = drain(sched)
    assert any(len(p.seqs) > 1 for p in plans)       # decodes beside prefill chunks
    assert [p.num_context_tokens for p in plans] == [_context_tokens(p) for p in plans]
    assert [p.num_new_tokens for p in plans] == [sum(s.num_new_tokens for s in p.seqs)
                                                 for p in plans]


def _first_swap_preemption(sched):
    for _ in range(100):
        plan = step(sched)
        if plan.swapped_out:
            return plan
    raise AssertionError("no sequence was swapped out")


def test_no_sequence_is_swapped_in_in_a_step_that_preempted():
    sched = preempting_scheduler(preemption="swap", swap_tokens=64)
    plan = _first_swap_preemption(sched)
    victim = plan.swapped_out[0]
    assert sched.state_of(victim) is SeqState.SWAPPED and victim not in {s.seq_id for s in plan.seqs}
    assert sched.seqs[victim].held == 0             # no device memory while swapped
    assert [s.seq_id for s in sched.swapped] == plan.swapped_out


def test_swapped_sequences_come_back_oldest_first():
    # four 8-token prompts in 40 tokens: growth swaps out the two newest, newest first
    sched = make(cache_tokens=40, max_tokens_per_step=40, preemption="swap", swap_tokens=64)
    for i in range(4):
        sched.add_request(Request(i, 8, 20))
    swapped_out, back = [], []
    for _ in range(500):
        if not sched.has_unfinished():
            break
        before = {s.seq_id for s in sched.swapped}
        plan = step(sched)
        swapped_out += plan.swapped_out
        back += [s.seq_id for s in plan.seqs if s.seq_id in before]
    assert len(set(swapped_out)) >= 2, swapped_out
    assert back == sorted(back), back
    assert sched.metrics.num_finished_requests == 4 and sched.metrics.recomputed_tokens == 0


def test_a_swapped_sequence_comes_back_while_one_below_max_running():
    # max_running 2: B, swapped out by a shrink, returns beside A once the pool is back
    sched = make(policy="vmem", cache_tokens=64, max_tokens_per_step=64, max_running=2,
                 preemption="swap", swap_tokens=64)
    sched.add_request(Request(0, 8, 12))
    sched.add_request(Request(1, 8, 12))
    step(sched)
    step(sched)
    full_bytes = sched.manager.cache_bytes
    assert sched.resize(full_bytes // 4, preempt=True, check_fit=False).swapped_out == [1]
    sched.resize(full_bytes, check_fit=False)
    plan = step(sched)
    assert [s.seq_id for s in plan.seqs] == [0, 1] and not sched.swapped
    assert [sched.state_of(i) for i in (0, 1)] == [SeqState.RUNNING] * 2


def test_a_request_id_already_queued_is_refused_and_nothing_changes():
    sched = make()
    assert sched.add_request(Request(7, 4, 2, n=2)) == [0, 1]
    with pytest.raises(DuplicateSequenceError, match="request 7"):
        sched.add_request(Request(7, 4, 2))
    assert [s.seq_id for s in sched.waiting] == [0] and sorted(sched.seqs) == [0]
    drain(sched)
    assert sched.metrics.num_finished_requests == 1
    assert sched.add_request(Request(7, 4, 2)) == [2]      # ended: its id may come again


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_aborting_a_running_request_releases_its_adapter(policy):
    sched = Scheduler(adapter_sched.manager(policy), SchedulerConfig(max_running=4))
    adapter = adapter_sched.ref("a", "a-weights", 2 * adapter_sched.PAGE)
    sched.add_request(Request(0, 8, 10, adapter=adapter))
    sched.add_request(Request(1, 8, 10, adapter=adapter))
    step(sched)
    assert sched.manager.adapter_uses(adapter) == 2
    assert sched.abort_request(0) == [0]
    assert sched.manager.adapter_uses(adapter) == 1
    adapter_sched.check_pins(sched)
    adapter_sched.run(sched)
    assert sched.manager.adapter_uses(adapter) == 0 and sched.manager.adapter_stats().pinned == 0


def test_aborted_sequences_are_reported_in_the_next_plans_finished():
    sched = make()
    sched.add_request(Request(0, 8, 10, n=2))      # running, two samples after its prefill
    sched.add_request(Request(1, 8, 10))
    step(sched)
    sched.add_request(Request(2, 8, 10))           # still waiting
    assert sched.abort_request(0) == [0, 1] and sched.abort_request(2) == [3]
    plan = sched.schedule()
    assert sorted(plan.finished) == [0, 1, 3] and [s.seq_id for s in plan.seqs] == [2]
    assert sched.metrics.num_aborted_requests == 2


def test_a_request_one_token_past_max_seq_len_is_refused_and_one_at_it_accepted():
    sched = make(max_seq_len=20)                   # the manager holds 64: the config's limit
    with pytest.raises(RequestTooLargeError, match=r"21 tokens.*max_seq_len 20"):
        sched.add_request(Request(0, 15, 6))
    assert sched.add_request(Request(1, 15, 5)) == [0]


def test_a_rolled_back_update_takes_back_its_latency_samples():
    sched = make()
    sched.add_request(Request(0, 8, 10, arrival_s=0.0))
    sched.add_request(Request(1, 8, 10, arrival_s=0.0))
    step(sched, now=1.0)                      # both first tokens: two TTFT samples
    step(sched, now=2.0)                      # two inter-token gaps
    m = sched.metrics
    kept = (m.ttft_s.since(), m.itl_s.since())
    sched.begin()
    sched.manager.begin()
    step(sched, now=3.5)
    assert m.itl_s.since() == [1.0, 1.0, 1.5, 1.5]
    sched.manager.rollback()
    sched.rollback()
    assert (m.ttft_s.since(), m.itl_s.since()) == kept == ([1.0, 1.0], [1.0, 1.0])
    step(sched, now=4.0)
    assert m.itl_s.since() == [1.0, 1.0, 2.0, 2.0]


def test_aborting_a_swapped_request_ends_it_and_reports_it():
    sched = preempting_scheduler(preemption="swap", swap_tokens=64)
    victim = _first_swap_preemption(sched).swapped_out[0]
    request_id = sched.seqs[victim].request.request_id
    assert sched.abort_request(request_id) == [victim]
    assert sched.state_of(victim) is SeqState.ABORTED and not sched.swapped
    assert victim in sched.schedule().finished


def test_a_resize_refuses_a_pool_one_token_short_of_a_waiting_request():
    sched = make(policy="vmem", cache_tokens=64)     # per-layer pages of 8 tokens
    sched.add_request(Request(0, 9, 8))               # 17 tokens
    with pytest.raises(CacheResizeError, match="request 0 needs 17 tokens.*hold 16 tokens"):
        sched.resize(16 * TINY.bytes_per_token)
    sched.resize(24 * TINY.bytes_per_token)
    drain(sched)
    assert sched.metrics.num_finished_requests == 1


def test_a_rollback_restores_whether_the_last_step_starved():
    # a budget's pool shrunk to its minimum: the head waits for growth (starved); rolled back,
    # the step never happened and the scheduler is not starved
    now = [0.0]
    budget = MemoryBudget(1024 * TINY.bytes_per_token, idle_release_s=1.0, clock=lambda: now[0])
    mgr = adapter_sched.manager("vmem", tokens=64, max_cache_bytes=256 * TINY.bytes_per_token)
    share = budget.register("lane", 32 * TINY.bytes_per_token, 256 * TINY.bytes_per_token,
                            64 * TINY.bytes_per_token)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.growable = True
    assert share.decide(sched) is None
    now[0] = 2.0                                   # idle: shrunk to its minimum
    resize(sched, share, share.decide(sched))
    sched.add_request(Request(0, 35, 4))
    assert not sched.starved
    sched.begin()
    sched.manager.begin()
    assert not sched.schedule().seqs and sched.starved
    sched.manager.rollback()
    sched.rollback()
    assert not sched.starved


def test_the_gauges_count_running_waiting_and_swapped_sequences():
    sched = preempting_scheduler(preemption="swap", swap_tokens=64)
    sched.add_request(Request(3, 8, 4))
    _first_swap_preemption(sched)                  # growth swaps the two newest out
    gauges = sched.gauges()
    counts = (gauges["num_requests_running"], gauges["num_requests_waiting"],
              gauges["num_requests_swapped"])
    assert counts == (len(sched.running), len(sched.waiting), len(sched.swapped)) == (2, 0, 2)
    assert gauges["num_preemptions"] == sched.metrics.num_preemptions == 2


def test_a_beam_search_wider_than_max_running_is_refused_and_as_wide_accepted():
    sched = make(max_running=4)
    with pytest.raises(RequestTooLargeError, match=r"beam_width 5 exceeds the 4 sequences"):
        sched.add_request(Request(0, 4, 4, beam_width=5))
    assert sched.add_request(Request(1, 4, 4, beam_width=4)) == [0]


def test_beams_forked_into_no_room_join_their_group_only_within_max_running():
    # max_running 4: A, B and a 4-beam search's first beam run; it branches 3 children, one
    # runs, two wait; A finishing frees one place, not two: they wait for B
    sched = make(max_running=4, max_tokens_per_step=64)
    sched.add_request(Request(0, 8, 3))
    sched.add_request(Request(1, 8, 12))
    sched.add_request(Request(2, 8, 10, beam_width=4))
    most_running = 0
    for _ in range(60):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        most_running = max(most_running, len(sched.running))
        sampled = {s.seq_id: 5 for s in plan.seqs if s.sample}
        for s in plan.seqs:
            if s.sample and sched.seqs[s.seq_id].beam_width and not sched.seqs[s.seq_id].output:
                sampled.update(dict.fromkeys(sched.branch(s.seq_id, 3), 6))
        sched.update(sampled)
    assert most_running == 4 and not sched.has_unfinished()
    assert sched.metrics.num_finished_requests == 3


def test_a_sequence_preempted_by_recompute_waits_with_nothing_computed_or_held():
    sched = preempting_scheduler()
    plan = step(sched)
    while not plan.preempted:
        plan = step(sched)
    victim = sched.seqs[plan.preempted[0]]
    assert victim.state is SeqState.WAITING and (victim.num_computed, victim.held) == (0, 0)


def test_aborting_a_request_ends_only_its_unended_samples():
    sched = make()
    parent, child = sched.add_request(Request(0, 8, 10, n=2))
    step(sched)                                    # prefill, fork
    sched.finish(child)
    assert sched.abort_request(0) == [parent]
    assert (sched.state_of(parent), sched.state_of(child)) == (SeqState.ABORTED, SeqState.FINISHED)
    assert sched.metrics.num_aborted_requests == 1 and sched.manager.stats().live_tokens == 0


def test_a_request_that_fills_the_pool_resized_back_up_is_refused_as_shrunk():
    sched = make(policy="vmem", cache_tokens=64)   # holds 64 tokens of one sequence at most
    sched.resize(16 * TINY.bytes_per_token)
    with pytest.raises(CacheShrunkError, match=r"64 tokens do not fit .*resized back up it holds 64"):
        sched.add_request(Request(0, 8, 56))
    assert sched.add_request(Request(1, 8, 8)) == [0]
