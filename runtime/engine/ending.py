"""A request ended early (aborted or failed) as a plan: what its sequences held leaves the
manager as ops, run as a step's are (``RequestLifecycle._end_request``, one transaction).

A failed request's K/V may be why it failed (a NaN an earlier step wrote that no check saw):
its sequences are unpublished first (``MemoryManager.unpublish``), so no later request with
the same prefix is served them and fails in turn; an aborted one's K/V were computed as any
other's and stay findable. A sequence preempted for recompute published what it had computed
when it was freed and the manager holds no record of it: failed while waiting (it cannot be
admitted any more, say), the units its tokens reach go too (``unpublish_tokens``).
"""
from __future__ import annotations

from vmemkv.scheduler.plan import StepPlan
from vmemkv.scheduler.request import SeqState

HELD_STATES = (SeqState.RUNNING, SeqState.SWAPPED)   # what the manager holds a record of


def ending_plan(scheduler, kv, request_id: int, status: SeqState) -> StepPlan:
    """End request ``request_id`` ``status`` in the scheduler (its sequences released) and
    return the plan of no sequences that carries what that frees and the table drops."""
    if status is SeqState.FAILED:
        for seq in scheduler.seqs.values():
            if seq.request.request_id == request_id:
                unpublish(scheduler, kv.manager, seq)
    seq_ids = scheduler.abort_request(request_id, status)
    return StepPlan([], kv.manager.take_ops(), finished=list(seq_ids),
                    tables=kv.tables.drop(seq_ids))


def unpublish(scheduler, manager, seq) -> None:
    """Nothing failing ``seq`` published or hit stays findable: resident or swapped, by its
    record; waiting after a preemption (admitted once: ``admit_order`` set), by its tokens
    under its request's prefix scope, as admission keyed them. One never admitted published
    nothing (what its tokens reach is other requests')."""
    if seq.state in HELD_STATES:
        manager.unpublish(seq.seq_id)
        return
    ids = seq.token_ids() if scheduler.config.enable_prefix_sharing else None
    if seq.state is SeqState.WAITING and seq.admit_order >= 0 and ids is not None:
        manager.unpublish_tokens(ids, seq.request.prefix_scope)
