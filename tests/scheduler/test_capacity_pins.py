"""The capacity search's edges, on a stand-in simulation whose figure is 100 ms per unit of
load: a target met exactly still holds, p100 is a percentile, the probe budget is a limit."""
import pytest

from vmemkv.scheduler import capacity
from vmemkv.scheduler.capacity import find_max_load, parse_slo, search_max_load
from vmemkv.scheduler.simulator import SimConfig


class _Linear:
    """``simulate``'s stand-in: a report whose every latency figure is 100 ms per unit of load."""

    def __init__(self, load: float) -> None:
        self.load = load

    def report(self, percentiles=()):
        return {"completed": 1, "p90_ttft_ms": 100.0 * self.load}


def test_a_load_whose_figure_equals_the_target_meets_it(monkeypatch):
    monkeypatch.setattr(capacity, "simulate", lambda entries, config: _Linear(entries))
    result = find_max_load(lambda load: load, SimConfig(), {"ttft_p90": 400.0}, start=1.0)
    assert [(p.load, p.meets) for p in result.probes[:4]] == [
        (1.0, True), (2.0, True), (4.0, True), (8.0, False)]
    assert result.max_load >= 4.0 and result.bounded


def test_p100_and_p0_are_percentiles_an_slo_may_name():
    assert parse_slo("ttft_p100=5,itl_p0=1") == {"ttft_p100": 5.0, "itl_p0": 1.0}


@pytest.mark.parametrize("max_probes", [1, 3, 6])
def test_the_search_runs_at_most_max_probes_simulations(max_probes):
    calls = []
    lo, hi = search_max_load(lambda load: calls.append(load) or load <= 5.0, 1.0, 0.01,
                             max_probes)
    assert len(calls) == max_probes and lo == max(c for c in calls if c <= 5.0)


def test_a_search_where_every_probe_meets_the_slo_is_not_bounded(monkeypatch):
    monkeypatch.setattr(capacity, "simulate", lambda entries, config: _Linear(entries))
    result = find_max_load(lambda load: load, SimConfig(), {"ttft_p90": 1e9}, max_probes=3)
    assert (result.max_load, result.bounded) == (4.0, False)
    assert [p.meets for p in result.probes] == [True] * 3
