"""run_plan: "mutate the manager, execute its ops" as one all-or-nothing unit.

It joins the two halves of a step that live in different layers (a scheduler-side manager and a
runtime cache), so it lives above both, outside runtime/cache.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from .cache import KVCache

T = TypeVar("T")


def run_plan(manager, cache: KVCache, mutate: Callable[[], T]) -> T:
    """Run "mutate the manager, take its ops, execute them" as one unit: all of it or none.

    ``mutate()`` makes manager calls (allocate, append, fork, free, swap_out, swap_in, ...; a
    scheduler's ``schedule()`` if the caller can undo the scheduler's own queues) and returns
    anything. Contract:
    - on success the ops are fully applied (with a background mapper this WAITS for the whole
      plan, giving up the mapper's overlap for this step) and the manager's changes committed;
      returns ``mutate()``'s result;
    - if ``mutate`` raises, or ``cache.execute`` fails part-way (a driver call, an OOM), the
      cache has undone what it applied, the manager is rolled back to its state before
      ``mutate`` (tables, counters, pending ops), and the error propagates: a scheduler error
      from ``mutate`` as is, a failed plan as ``PlanExecutionError`` (``MapperPlanError`` with
      a background mapper). No page is leaked, no sequence lost, every sequence's cached
      contents are as before, and the same step may simply be retried;
    - the manager must have no open transaction (they do not nest) and no ops pending from
      before (they would be executed, or restored as pending on failure);
    - if undoing memory itself failed (``PlanExecutionError.rolled_back`` is False) the cache
      refuses further use; close it. State OUTSIDE the manager and cache (request queues,
      sampled tokens, table edits) is the caller's to undo or send.
    """
    manager.begin()
    try:
        result = mutate()
        cache.execute(manager.take_ops())
        cache.wait_for_plan()
    except BaseException:
        manager.rollback()
        raise
    manager.commit()
    return result
