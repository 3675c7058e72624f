"""Publish on compute, in the scheduler: with prefix sharing on, the step that computes a
sequence's last token of a unit (a prefill chunk, or a decode that fills exactly one unit)
publishes that unit in the same ``update``, so a request arriving at the next step can hit it."""
import pytest

from vmemkv.scheduler.request import Request

from .test_scheduler_liveness import POLICIES, make_scheduler

PAGED_AND_VMEM = [p for p in POLICIES if p[0] in ("paged", "vmem")]


def hit_now(manager, ids) -> int:
    """Tokens a request for ``ids`` would hit now (asked in a transaction rolled back)."""
    manager.begin()
    try:
        return manager.allocate(10**6, len(ids), ids)      # an id no sequence has
    finally:
        manager.rollback()


@pytest.mark.parametrize("policy,layout", PAGED_AND_VMEM)
def test_every_unit_a_step_fills_is_published_by_that_steps_update(policy, layout):
    sched = make_scheduler(policy, layout, enable_prefix_sharing=True)
    unit = sched.manager.prefix_unit_tokens
    prompt = list(range(100, 100 + unit + 2))           # one full unit and 2 tokens of the next
    sched.add_request(Request(0, len(prompt), 4 * unit, prompt_token_ids=prompt))
    seq = sched.seqs[0]
    filled = []                                         # decode steps that completed a unit
    for step in range(2 * unit + 2):
        plan = sched.schedule()
        sched.update({s.seq_id: 7 + step for s in plan.seqs if s.sample})
        computed = seq.num_computed
        full = computed // unit * unit                  # tokens in full, computed units
        # one more id: a hit never covers a request's last token
        assert hit_now(sched.manager, seq.token_ids()[:computed] + [1]) == full, (step, computed)
        if step and computed == full:
            filled.append(step)
    assert len(filled) >= 2                             # units 1 and 2 were filled by decodes
