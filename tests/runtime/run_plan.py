"""``run_plan``: manager calls and the execution of their ops as one StepTransaction (the way
the reliability and swap tests drive a lone manager and cache)."""
from __future__ import annotations

from typing import Callable, TypeVar

from vmemkv.runtime.transaction import StepTransaction, cache_executor
from vmemkv.scheduler.plan import StepPlan

T = TypeVar("T")


def run_plan(manager, cache, mutate: Callable[[], T]) -> T:
    """``mutate()`` (allocate, append, fork, free, swap_out, ...) then its ops on ``cache``,
    all or nothing; returns ``mutate()``'s result. A failure undoes the manager (the cache
    undid its memory) and propagates (a failed plan as ``PlanExecutionError``)."""
    result: list = []

    def make_plan() -> StepPlan:
        result.append(mutate())
        return StepPlan([], manager.take_ops())

    StepTransaction(manager, cache_executor(cache)).run(make_plan)
    return result[0]
