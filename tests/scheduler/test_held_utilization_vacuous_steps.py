"""A step that ends holding nothing (every sequence it ran finished) has no held utilisation; it
counted as 100% (and as 100% live/allocated where nothing was allocated), so 30 requests of one
output token each read "held utilisation 100.0%" beside "kv utilisation 0.0%", and two-token
outputs about 55%, half the steps at 100%. The means are now over the steps that hold (or
allocate) anything, and null where none did; a run whose steps all hold memory is unchanged."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.sim_sums import StepSums
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry

CONFIG = dict(cache_bytes=4 * 10**9, max_seq_len=512)


def one_at_a_time(output_len: int):
    """30 requests far enough apart that each runs alone."""
    return [TraceEntry(100, output_len, 10.0 * i) for i in range(30)]


@pytest.mark.parametrize("policy", ["paged", "vmem", "reserve-max"])
def test_one_token_outputs_hold_nothing_after_any_step_so_no_held_figure(policy):
    result = simulate(one_at_a_time(1), SimConfig(policy=policy, **CONFIG))
    assert result.num_requests == 30
    assert result.held_utilization is None
    assert result.kv_utilization is None or result.kv_utilization < 0.5


@pytest.mark.parametrize("policy", ["paged", "reserve-max"])
def test_two_token_outputs_are_the_mean_of_the_steps_that_hold(policy):
    result = simulate(one_at_a_time(2), SimConfig(policy=policy, **CONFIG))
    # after each request's first step it holds its 100 prompt tokens (paged: in 16-token
    # blocks, 112 allocated; reserve-max: 512 reserved); after its second nothing
    expected = {"paged": 100 / 112, "reserve-max": 100 / 512}[policy]
    assert result.held_utilization == pytest.approx(expected)


def test_steps_without_the_figures_leave_their_means_absent():
    sums = StepSums()
    sums.add(3, (None, None, 0.0, 0.0), 0.1, 3)
    means = sums.means()
    assert (means["kv_utilization"], means["held_utilization"]) == (None, None)
    assert means["mean_batch"] == 3.0
