"""MemoryBudget and the several-models simulator refuse by name what they cannot honour."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.shared_sim import SharedConfig, SharedSimulator
from vmemkv.scheduler.workload import TraceEntry


@pytest.mark.parametrize("idle", [float("inf"), 1e10])
def test_an_idle_delay_past_the_limit_is_refused_naming_the_range(idle):
    # it said "must be seconds >= 0" of a value that is >= 0
    with pytest.raises(ConfigError, match=r"idle_release_s must be seconds in \[0, 1e9\)"):
        MemoryBudget(1 << 20, idle_release_s=idle)


def test_minimums_that_exceed_the_budget_are_refused_not_lowered():
    # two models at min_fraction 0.6 were each given 0.5 as their minimum, silently
    lanes = {"a": [TraceEntry(100, 10, 0.0)], "b": [TraceEntry(100, 10, 0.0)]}
    with pytest.raises(ConfigError, match=r"min_fraction=0.6 .* 2 models, 1.2 .* at most 1/2"):
        SharedSimulator(lanes, SharedConfig(total_bytes=1 << 30, min_fraction=0.6))
    at_half = SharedSimulator(lanes, SharedConfig(total_bytes=1 << 30, min_fraction=0.5))
    assert [lane.share.min_bytes for lane in at_half.lanes] == [1 << 29, 1 << 29]
