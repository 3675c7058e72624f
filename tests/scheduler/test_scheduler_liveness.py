"""Liveness: with a tiny cache and adversarial lengths every submitted request finishes, for
every policy and both preemption modes; and the scheduler's bookkeeping invariants hold on
random workloads (hypothesis)."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = get_model("tiny")       # 4,096 bytes per token
MAX_LEN = 64                   # tokens; vmem pages of 4 KiB hold 8 (per-layer) / 2 (interleaved)
POLICIES = [("reserve-max", "per-layer"), ("reserve-oracle", "per-layer"), ("paged", "per-layer"),
            ("vmem", "per-layer"), ("vmem", "interleaved")]


def make_scheduler(policy, layout, cache_tokens=128, swap_tokens=64, **config):
    mgr = make_manager(policy, TINY, cache_tokens * TINY.bytes_per_token, MAX_LEN,
                       block_size_tokens=4, page_bytes=4096, layout=layout,
                       swap_bytes=swap_tokens * TINY.bytes_per_token)
    config.setdefault("check_every_step", True)
    return Scheduler(mgr, SchedulerConfig(**config))


def check_states(sched):
    """Every sequence is in exactly one state, and the queues agree with the states."""
    where = {}
    for name, queue in (("waiting", sched.waiting), ("running", sched.running),
                        ("swapped", sched.swapped)):
        for seq in queue:
            assert seq.seq_id not in where, f"{seq} in {where.get(seq.seq_id)} and {name}"
            where[seq.seq_id] = name
    for seq in sched.seqs.values():
        assert where.get(seq.seq_id, "finished") == seq.state.value, seq
        if seq.state is SeqState.RUNNING:
            assert sched.manager.num_tokens(seq.seq_id) == seq.held >= seq.num_computed, seq
        assert len(seq.output) <= seq.max_tokens


def check_plan(sched, plan):
    cfg = sched.config
    ids = [s.seq_id for s in plan.seqs]
    assert len(ids) == len(set(ids)) <= cfg.max_running
    assert plan.num_new_tokens == sum(s.num_new_tokens for s in plan.seqs) <= cfg.max_tokens_per_step
    for s in plan.seqs:
        seq = sched.seqs[s.seq_id]
        assert seq.state is SeqState.RUNNING and s.num_computed_tokens == seq.num_computed
        assert s.sample == (s.num_computed_tokens + s.num_new_tokens == seq.length)
        assert seq.held >= s.num_computed_tokens + s.num_new_tokens


def run_to_completion(sched, rng, pending=(), max_steps=20_000):
    """Drive the scheduler, submitting ``pending`` requests a few at a time between steps."""
    pending = list(pending)
    for _ in range(max_steps):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished():
            if not pending:
                return
            continue
        plan = sched.schedule()
        check_plan(sched, plan)
        sampled = {s.seq_id: rng.randrange(10) for s in plan.seqs if s.sample}
        for s in plan.seqs:
            sampled.update({c: rng.randrange(10) for c in s.fork_ids})
        sched.update(sampled)
        check_states(sched)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.gauges()}")


def adversarial_requests():
    lengths = [(1, 63), (63, 1), (32, 32), (60, 4), (1, 1), (40, 24), (2, 62), (17, 30)]
    return [Request(i, p, o, n=1 + i % 3 if p + o <= 40 else 1,
                    stop_token_ids=(7,) if i % 4 == 0 else ())
            for i, (p, o) in enumerate(lengths * 3)]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("policy,layout", POLICIES)
def test_every_request_finishes_on_a_tiny_cache(policy, layout, preemption):
    sched = make_scheduler(policy, layout, preemption=preemption, max_running=8,
                           max_tokens_per_step=16, watermark=0.05)
    requests = adversarial_requests()
    run_to_completion(sched, random.Random(0), requests)
    assert sched.metrics.num_finished_requests == len(requests)
    assert all(s.state is SeqState.FINISHED for s in sched.seqs.values())
    assert len(sched.seqs) == sum(r.n for r in requests)
    st = sched.manager.stats()
    assert st.live_tokens == 0 and st.end_waste_tokens == 0
    if policy in ("paged", "vmem"):
        assert sched.metrics.num_preemptions > 0    # the cache really was too small


@settings(max_examples=150)
@given(policy=st.sampled_from(POLICIES), preemption=st.sampled_from(["recompute", "swap"]),
       watermark=st.sampled_from([0.0, 0.05, 0.3]), max_running=st.sampled_from([1, 3, 16]),
       budget=st.sampled_from([16, 40]), share=st.booleans(), seed=st.integers(0, 2**16),
       reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24), st.integers(1, 3),
                               st.booleans()), min_size=1, max_size=12))
def test_scheduler_never_drops_and_every_sequence_has_one_state(
        policy, preemption, watermark, max_running, budget, share, seed, reqs):
    sched = make_scheduler(policy[0], policy[1], cache_tokens=160, preemption=preemption,
                           watermark=watermark, max_running=max_running,
                           max_tokens_per_step=budget, enable_prefix_sharing=share)
    rng = random.Random(seed)
    requests = [Request(i, p, o, n=n, prompt_token_ids=[rng.randrange(2) for _ in range(p)],
                        stop_token_ids=(7,) if stop else (), namespace="a" if i % 2 else None)
                for i, (p, o, n, stop) in enumerate(reqs)]
    run_to_completion(sched, rng, requests)
    assert sched.metrics.num_finished_requests == len(requests)
    for seq in sched.seqs.values():
        assert seq.state is SeqState.FINISHED
        out = seq.output
        assert 1 <= len(out) <= seq.max_tokens
        assert len(out) == seq.max_tokens or out[-1] in seq.stop_ids
