"""No result depends on the order shares registered in (scheduler/budget.py) nor on the order
the several-models simulator was given its workloads (scheduler/shared_sim.py). Pressure fell on
the equally spare share registered first, and lanes whose turns fell at the same simulated time
acted in the workloads' order (the first one stamped older): three models listed a, b, c and
c, b, a gave 209 and 186 preemptions."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.shared_sim import SharedConfig, simulate_shared
from vmemkv.scheduler.shared_workloads import BurstySpec, bursty_workload
from vmemkv.scheduler.trace_entry import TraceEntry

from .test_budget_rule import BPT, lane

ORDERS = (("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a"))


def _results_in_every_order(workloads, config) -> dict:
    """{order: the run's result as JSON (wall time left out; NaN equals NaN)}."""
    out = {}
    for order in ORDERS:
        got = simulate_shared({k: workloads[k] for k in order}, config).to_dict()
        del got["wall_seconds"]
        out[order] = json.dumps(got, sort_keys=True)
    return out


def _assert_order_free(workloads, config) -> dict:
    results = _results_in_every_order(workloads, config)
    first = results[ORDERS[0]]
    for order, result in results.items():
        assert result == first, f"workloads in the order {order} gave another result"
    return json.loads(first)["overall"]


def test_bursts_on_three_models_give_the_same_results_in_any_workload_order():
    workloads = bursty_workload(BurstySpec(models=("a", "b", "c"), duration_s=3.0,
                                           period_s=3.0, burst_fraction=1.0, burst_rate=10.0,
                                           quiet_rate=0.0, seed=5))
    overall = _assert_order_free(workloads, SharedConfig(
        elastic=True, min_fraction=0.1, idle_release_s=2.0, total_bytes=6 << 30))
    # the run moves memory between the models: pressure and yields decide something
    assert overall["grows"] > 0 and overall["gives"] > 0 and overall["num_preemptions"] > 0
    assert overall["num_requests"] == sum(map(len, workloads.values()))


def test_turns_at_the_same_time_go_by_name_not_by_the_workloads_order():
    rng = random.Random(3)          # arrivals on whole seconds: the lanes' turns coincide
    workloads = {k: [TraceEntry(rng.randint(200, 2400), rng.randint(50, 600),
                                float(rng.randint(0, 4))) for _ in range(rng.randint(5, 15))]
                 for k in "abc"}
    overall = _assert_order_free(workloads, SharedConfig(
        elastic=True, min_fraction=0.1, idle_release_s=1.0, total_bytes=1 << 30))
    assert overall["num_preemptions"] > 0
    assert overall["num_requests"] == sum(map(len, workloads.values()))


@pytest.mark.parametrize("held_tokens, pressed", [({"x": 128, "y": 128}, "x"),
                                                   ({"x": 112, "y": 144}, "y")])
def test_pressure_falls_on_the_most_spare_share_then_by_name_in_any_registration_order(
        held_tokens, pressed):
    """c (64 tokens, nothing free) asks for 36 more: the most spare share is asked for all of
    it; of two equally spare shares, the first by name."""
    for order in itertools.permutations("xyc"):
        budget = MemoryBudget(320 * BPT, grow_fraction=0.125, clock=lambda: 0.0)
        lanes = {n: lane(budget, n, {**held_tokens, "c": 64}[n]) for n in order}
        sched, asking = lanes["c"]
        sched.add_request(Request(0, prompt_len=90, max_tokens=10))
        assert asking.decide(sched) is None and asking.blocked
        pressure = {n: share.pressure_bytes for n, (_, share) in lanes.items()}
        assert pressure == {"x": 0, "y": 0, "c": 0, pressed: 36 * BPT}, order


def test_a_second_share_of_the_same_name_is_refused_and_changes_nothing():
    """Names break the rule's ties, so they are unique."""
    budget = MemoryBudget(320 * BPT, clock=lambda: 0.0)
    budget.register("x", 32 * BPT, 256 * BPT, 128 * BPT)
    before = budget.stats()
    with pytest.raises(ConfigError, match="'x' is already registered"):
        budget.register("x", 0, 64 * BPT)
    assert budget.stats() == before
