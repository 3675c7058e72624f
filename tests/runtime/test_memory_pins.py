"""runtime/memory.py's checks pinned at their limits."""
from __future__ import annotations

import pytest

from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.memory import check_fraction


@pytest.mark.parametrize("fraction", [1.0, 0.5, 1e-9])
def test_a_memory_utilization_in_0_to_1_is_taken(fraction):
    check_fraction("memory_utilization", fraction)


@pytest.mark.parametrize("fraction", [0.0, 1.0000001, 1.5, -0.5, float("nan")])
def test_a_memory_utilization_outside_0_to_1_is_refused_by_name(fraction):
    with pytest.raises(CacheConfigError, match=r"memory_utilization must be a fraction in \(0, 1\]"):
        check_fraction("memory_utilization", fraction)
