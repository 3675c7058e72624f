"""A user's policy whose ``stats()`` returns no MemoryStats (None) is refused with the
ManagerContractError the docs promise, naming the class and ``stats()``, when the scheduler
first reads it (building its capacity): it was an AttributeError from pool_reach.py, which a
simulation reported as a PolicyError about code outside the policy's methods."""
import sys

import pytest

from vmemkv.scheduler.managers import PagedManager
from vmemkv.scheduler.managers.base import ManagerContractError
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.scheduler import Scheduler
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry

MODEL = ModelSpec("t", 2, 1, 8, 2, 0)


class StatsNone(PagedManager):
    def __init__(self, model=MODEL, cache_bytes=64 * 2048, max_seq_len_tokens=256, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=16)
        self.name = "stats-none"

    def stats(self):
        return None


def test_a_scheduler_over_it_is_refused_naming_stats():
    with pytest.raises(ManagerContractError, match=r"^policy 'stats-none': StatsNone\.stats\(\) "
                                                   r"returned None; required: a MemoryStats$"):
        Scheduler(StatsNone())


def test_a_simulation_of_it_is_refused_naming_stats(monkeypatch):
    monkeypatch.setitem(sys.modules, "stats_none_policies", sys.modules[__name__])
    with pytest.raises(ManagerContractError, match=r"StatsNone\.stats\(\) returned None"):
        simulate([TraceEntry(8, 4, 0.0)], SimConfig(policy="stats_none_policies:StatsNone",
                                                    cache_bytes=2 * 10**9))
