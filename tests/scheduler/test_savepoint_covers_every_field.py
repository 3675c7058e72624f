"""A scheduler step rolled back leaves every field of the scheduler as it was, not only those
the Savepoint was written for: each step of a run is first scheduled and rolled back, and a
fingerprint of all the scheduler's own fields (queues, sets, counters, sequence states) is
compared. The run swaps a beam group out and back in: ``_private_orders`` (the beam groups that
came back each beam with its own copy) kept a rolled-back swap-in's groups."""
from __future__ import annotations

from collections import deque

from vmemkv.scheduler.request import Request

from .test_scheduler_liveness import make_scheduler

SIMPLE = (int, float, bool, str, type(None))


def fingerprint(sched) -> dict:
    def ids(value):
        return value.seq_id if hasattr(value, "seq_id") else value
    out = {}
    for name, value in vars(sched).items():
        if name == "_savepoint":
            continue
        if isinstance(value, SIMPLE):
            out[name] = value
        elif isinstance(value, (set, frozenset)):
            out[name] = set(value)
        elif isinstance(value, (list, deque, tuple)):
            out[name] = [ids(v) for v in value]
        elif isinstance(value, dict):
            out[name] = {k: ids(v) for k, v in value.items()}
    out["seq states"] = {sid: seq.save() for sid, seq in sched.seqs.items()}
    metrics = sched.metrics
    names = vars(metrics) if hasattr(metrics, "__dict__") else metrics.__slots__
    out["metrics"] = {k: getattr(metrics, k) for k in names
                      if isinstance(getattr(metrics, k), SIMPLE)}
    return out


def test_every_step_of_a_beam_swap_run_rolls_back_to_the_same_fingerprint():
    sched = make_scheduler("paged", "per-layer", cache_tokens=48, swap_tokens=256,
                           max_running=8, max_tokens_per_step=64, preemption="swap")
    mgr = sched.manager
    sched.add_request(Request(0, 32, 3, prompt_token_ids=[7] * 32))
    sched.add_request(Request(1, 12, 4, prompt_token_ids=[1] * 12, beam_width=4))
    swapped_in = 0
    for _ in range(60):
        if not sched.has_unfinished():
            break
        before = fingerprint(sched)
        sched.begin()
        mgr.begin()
        sched.schedule()
        swapped_in += bool(sched._private_orders - before["_private_orders"])
        mgr.rollback()
        sched.rollback()
        assert fingerprint(sched) == before
        sched.begin()
        mgr.begin()
        plan = sched.schedule()
        sampled = {s.seq_id: 7 for s in plan.seqs if s.sample}
        for s in plan.seqs:
            beam = sched.seqs[s.seq_id]
            if s.sample and beam.beam_width:
                sampled[s.seq_id] = 5 if beam.output else 1
                if not beam.output:
                    sampled.update(zip(sched.branch(s.seq_id, 3), (2, 3, 4)))
        sched.update(sampled)
        sched.commit()
        mgr.commit()
        for seq_id, seq in list(sched.seqs.items()):
            if seq.state.is_ended:
                sched.forget(seq_id)
    assert swapped_in >= 1 and not sched.has_unfinished()
    assert sched.metrics.num_finished_requests == 2
