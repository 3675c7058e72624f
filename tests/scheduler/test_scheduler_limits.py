"""Scheduler behaviour, one property per test: admission limits, chunked prefill, preemption
order, swap priority, forks, prefix sharing, finishing, metrics."""
import pytest

from vmemkv.scheduler.errors import ConfigError, RequestTooLargeError, SchedulerError
from vmemkv.scheduler.managers import MapExtent, make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = get_model("tiny")
MAX_LEN = 64


def make(policy="paged", cache_tokens=128, swap_tokens=0, layout="per-layer", **config):
    mgr = make_manager(policy, TINY, cache_tokens * TINY.bytes_per_token, MAX_LEN,
                       block_size_tokens=4, page_bytes=4096, layout=layout,
                       swap_bytes=swap_tokens * TINY.bytes_per_token)
    config.setdefault("check_every_step", True)
    config.setdefault("max_running", 8)
    return Scheduler(mgr, SchedulerConfig(**config))


def step(sched, token=1, now=None):
    plan = sched.schedule()
    sampled = {s.seq_id: token for s in plan.seqs if s.sample}
    for s in plan.seqs:
        sampled.update(dict.fromkeys(s.fork_ids, token + 1))
    sched.update(sampled, now)
    return plan


def drain(sched, limit=5000):
    plans = []
    while sched.has_unfinished() and len(plans) < limit:
        plans.append(step(sched))
    assert not sched.has_unfinished()
    return plans


def test_request_longer_than_max_seq_len_is_rejected_naming_both_numbers():
    with pytest.raises(RequestTooLargeError, match=r"70.*64"):
        make().add_request(Request(0, 60, 10))


def test_request_larger_than_the_whole_cache_is_rejected_naming_both_numbers():
    with pytest.raises(RequestTooLargeError, match=r"40.*32"):
        make(cache_tokens=32).add_request(Request(0, 30, 10))


def test_chunked_prefill_splits_a_long_prompt_within_the_token_budget():
    sched = make(max_tokens_per_step=16, max_running=4)
    sched.add_request(Request(0, 50, 2, prompt_token_ids=list(range(50))))
    got = [(s.num_computed_tokens, s.num_new_tokens, s.sample, s.new_token_ids)
           for p in drain(sched) for s in p.seqs]
    assert got == [(0, 16, False, tuple(range(16))), (16, 16, False, tuple(range(16, 32))),
                   (32, 16, False, tuple(range(32, 48))), (48, 2, True, (48, 49)), (50, 1, True, (1,))]


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make(max_tokens_per_step=16, max_running=4)
    sched.add_request(Request(0, 4, 10))
    step(sched)
    sched.add_request(Request(1, 60, 2))
    plan = step(sched)
    assert [(s.seq_id, s.num_new_tokens) for s in plan.seqs] == [(0, 1), (1, 15)]


def test_watermark_blocks_admission_while_others_run():
    # 128 tokens, watermark 25% = 32 tokens. A holds 40, leaving 88: B (60) would leave 28 < 32.
    for watermark, admitted in ((0.25, False), (0.0, True)):
        sched = make(watermark=watermark, max_tokens_per_step=128)
        sched.add_request(Request(0, 40, 20))
        step(sched)
        sched.add_request(Request(1, 60, 4))
        step(sched)
        assert (sched.state_of(1) is SeqState.RUNNING) == admitted


def test_watermark_never_blocks_an_idle_cache():
    sched = make(watermark=0.9)
    sched.add_request(Request(0, 60, 4))
    step(sched)
    assert sched.state_of(0) is SeqState.RUNNING


def test_max_running_is_respected():
    sched = make(max_running=2, max_tokens_per_step=32)
    for i in range(5):
        sched.add_request(Request(i, 4, 6))
    while sched.has_unfinished():
        plan = step(sched)
        assert len(plan.seqs) <= 2 and len(sched.running) <= 2
    assert sched.metrics.num_finished_requests == 5


def test_admission_is_first_come_first_served():
    sched = make(max_running=1)
    for i in range(4):
        sched.add_request(Request(i, 3, 2))
    first_seen = []
    for plan in drain(sched):
        first_seen += [s.seq_id for s in plan.seqs if s.seq_id not in first_seen]
    assert first_seen == [0, 1, 2, 3]


def preempting_scheduler(**kw):
    # 32 tokens = 8 blocks; three prompts of 8 tokens then growth until the cache is full
    sched = make(cache_tokens=32, max_tokens_per_step=32, **kw)
    for i in range(3):
        sched.add_request(Request(i, 8, 20))
    return sched


def test_preemption_takes_the_most_recently_admitted_sequence():
    sched = preempting_scheduler()
    while True:
        plan = step(sched)
        if plan.preempted:
            break
    assert plan.preempted == [2] and sched.state_of(2) is SeqState.WAITING
    assert sched.waiting[0].seq_id == 2
    assert sched.metrics.num_preemptions == 1 and sched.metrics.recomputed_tokens == 8  # its prompt
    drain(sched)
    assert sched.metrics.num_finished_requests == 3


def test_recomputed_sequence_reprefills_prompt_and_generated_tokens():
    sched = preempting_scheduler()
    while not step(sched).preempted:
        pass
    victim = sched.seqs[2]
    length = victim.length
    while sched.state_of(2) is not SeqState.RUNNING:
        plan = step(sched)
    entry = next(s for s in plan.seqs if s.seq_id == 2)
    assert (entry.num_computed_tokens, entry.num_new_tokens, entry.sample) == (0, length, True)


def test_swapped_sequences_come_back_before_new_admissions():
    sched = preempting_scheduler(preemption="swap", swap_tokens=64)
    step(sched)
    for i in range(3, 7):
        sched.add_request(Request(i, 8, 20))
    blocked = 0
    while sched.has_unfinished():
        waiting_before = {s.seq_id for s in sched.waiting}
        plan = sched.schedule()
        admitted = [s.seq_id for s in plan.seqs if s.seq_id in waiting_before]
        assert not (admitted and sched.swapped), "admitted while a swapped sequence waits"
        blocked += bool(sched.swapped and sched.waiting)
        sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    assert blocked and sched.metrics.num_swap_preemptions >= 1
    assert sched.metrics.recomputed_tokens == 0 and sched.metrics.num_finished_requests == 7


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    sched = preempting_scheduler(preemption="swap")   # swap_tokens=0: no host space
    drain(sched)
    assert sched.metrics.num_preemptions >= 1 and sched.metrics.num_swap_preemptions == 0
    assert sched.metrics.recomputed_tokens > 0


def test_forked_children_share_the_prompt_memory():
    sched = make(max_tokens_per_step=64)
    sched.add_request(Request(0, 16, 5, n=3))
    plan = step(sched)
    assert plan.seqs[0].fork_ids == (1, 2)
    assert [sched.state_of(i) for i in range(3)] == [SeqState.RUNNING] * 3
    st = sched.manager.stats()
    assert st.live_tokens == 16 and st.allocated_tokens == 16     # one copy of the prompt
    assert [s.seq_id for s in step(sched).seqs] == [0, 1, 2]
    drain(sched)
    assert [len(sched.seqs[i].output) for i in range(3)] == [5, 5, 5]


def test_fork_that_does_not_fit_waits_as_recompute_and_keeps_its_token():
    sched = make(max_running=1)
    sched.add_request(Request(0, 5, 3, n=2))
    step(sched, token=4)                        # the child gets token 5
    assert sched.state_of(1) is SeqState.WAITING and sched.seqs[1].output == [5]
    drain(sched)
    assert sched.seqs[1].output[0] == 5 and len(sched.seqs[1].output) == 3


def test_prefix_sharing_skips_cached_tokens_within_a_namespace():
    sched = make(enable_prefix_sharing=True, max_tokens_per_step=64)
    prompt = list(range(1, 33))
    sched.add_request(Request(0, 32, 2, prompt_token_ids=prompt))
    drain(sched)
    sched.add_request(Request(1, 40, 2, prompt_token_ids=prompt + [9] * 8))
    sched.add_request(Request(2, 40, 2, prompt_token_ids=prompt + [9] * 8, namespace="lora-a"))
    plan = step(sched)
    computed = {s.seq_id: s.num_computed_tokens for s in plan.seqs}
    assert computed[1] == 32 and computed[2] == 0
    assert sched.gauges()["prefix_cache_hits"] >= 32


def test_prefix_hit_is_not_granted_before_its_owner_has_computed_it():
    # Publish on compute: B, admitted in the step where A computes its prompt, finds nothing
    # cached and computes everything; C, admitted after A's prefill step, hits A's blocks.
    sched = make(enable_prefix_sharing=True, max_tokens_per_step=80)
    prompt = list(range(1, 33))
    sched.add_request(Request(0, 32, 3, prompt_token_ids=prompt))
    sched.add_request(Request(1, 34, 3, prompt_token_ids=prompt + [5, 6]))
    plan = step(sched)
    assert {s.seq_id: s.num_computed_tokens for s in plan.seqs} == {0: 0, 1: 0}
    assert sched.gauges()["prefix_cache_hits"] == 0
    sched.add_request(Request(2, 34, 3, prompt_token_ids=prompt + [7, 8]))
    plan = step(sched)
    assert {s.seq_id: s.num_computed_tokens for s in plan.seqs}[2] == 32
    assert sched.gauges()["prefix_cache_hits"] == 32
    drain(sched)


def test_stop_token_and_max_tokens_finish_a_sequence():
    sched = make()
    sched.add_request(Request(0, 4, 10, stop_token_ids=(7,)))
    sched.add_request(Request(1, 4, 3))
    step(sched, token=1)
    step(sched, token=7)
    assert sched.state_of(0) is SeqState.FINISHED and sched.seqs[0].output == [1, 7]
    assert sched.state_of(1) is SeqState.RUNNING
    step(sched, token=7)
    assert sched.state_of(1) is SeqState.FINISHED     # 3 tokens; stop ids are per request


def test_finished_ids_are_reported_in_the_next_plan():
    sched = make()
    sched.add_request(Request(0, 4, 1))
    assert sched.schedule().finished == []
    assert sched.update({0: 3}) == [0]
    assert sched.schedule().finished == [0]


def test_plan_carries_the_managers_ops_for_vmem():
    sched = make(policy="vmem")
    sched.add_request(Request(0, 20, 2))
    plan = step(sched)
    assert any(type(op) is MapExtent for op in plan.ops)


def test_integrity_is_checked_whenever_the_scheduler_is_idle(monkeypatch):
    sched = make(check_every_step=False)
    calls = []
    monkeypatch.setattr(sched.manager, "check_idle", lambda: calls.append(1))
    sched.add_request(Request(0, 4, 3))
    drain(sched)
    assert calls == [1]


def test_ttft_and_inter_token_latency_use_the_given_clock():
    sched = make()
    sched.add_request(Request(0, 4, 3, arrival_s=1.0))
    for now in (1.5, 1.75, 2.25):
        step(sched, now=now)
    assert sched.metrics.ttft_s.since() == [0.5] and sched.metrics.itl_s.since() == [0.25, 0.5]


def test_schedule_twice_without_update_is_an_error():
    sched = make()
    sched.add_request(Request(0, 4, 3))
    sched.schedule()
    with pytest.raises(SchedulerError):
        sched.schedule()


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_running=0), "max_running"), (dict(max_running=64, max_tokens_per_step=32), "max_tokens_per_step"),
    (dict(watermark=1.0), "watermark"), (dict(watermark=-0.1), "watermark"),
    (dict(preemption="drop"), "preemption"),
])
def test_bad_scheduler_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**kwargs)


def test_forget_drops_only_ended_sequences():
    from vmemkv.scheduler.errors import SchedulerError, UnknownSequenceError
    from vmemkv.scheduler.managers import make_manager
    from vmemkv.scheduler.presets import get_model
    from vmemkv.scheduler.request import Request
    from vmemkv.scheduler.scheduler import Scheduler
    manager = make_manager("paged", get_model("tiny"), 1 << 20, 64, block_size_tokens=4)
    scheduler = Scheduler(manager)
    (seq_id,) = scheduler.add_request(Request(request_id=0, prompt_len=3, max_tokens=1))
    with pytest.raises(SchedulerError, match="waiting, not ended"):
        scheduler.forget(seq_id)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    scheduler.forget(seq_id)
    assert seq_id not in scheduler.seqs
    with pytest.raises(UnknownSequenceError):
        scheduler.forget(seq_id)


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_finish_ends_one_sample_early_and_frees_it_like_a_stop_token(policy):
    """What the engine's stop strings use: one of n samples finishes now, its memory comes back
    with the next plan, its siblings go on; finishing an ended one changes nothing."""
    sched = make(policy)
    parent, *children = sched.add_request(Request(0, 8, 10, n=3))
    step(sched)                                         # prefill, forks
    sched.finish(children[0])
    assert sched.state_of(children[0]) is SeqState.FINISHED
    assert children[0] in step(sched).finished
    sched.finish(children[0])                           # already ended: no-op
    plans = drain(sched)
    assert all(children[0] not in [s.seq_id for s in p.seqs] for p in plans)
    assert sched.manager.stats().live_tokens == 0
    with pytest.raises(SchedulerError, match="unknown sequence"):
        sched.finish(999)
