"""The several-models simulator's inputs (scheduler/shared_config.py, shared_workloads.py), each
refused by a ConfigError naming the field and the value, before anything runs: they hung (an
infinite duration, a nanosecond period, a NaN shift), ran out of memory (1e12 requests/s), or
were numpy's or Python's own errors, or accepted and ignored."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.shared_config import SharedConfig
from vmemkv.scheduler.shared_sim import SharedSimulator, simulate_shared
from vmemkv.scheduler.shared_workloads import BurstySpec, shifted_traces
from vmemkv.scheduler.workload import TraceEntry

GB = 10**9
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("fields, message", [
    (dict(total_bytes=INF), r"total_bytes must be None or an int of bytes >= page_bytes "
                            r"\(2097152: one page\), got inf"),
    (dict(total_bytes=1, elastic=False), r"total_bytes .* got 1$"),
    (dict(total_bytes=True), r"total_bytes .* got True"),
    (dict(total_bytes=4e9), r"total_bytes .* got 4000000000.0"),
    (dict(grow_page_s=INF), r"grow_page_s must be seconds in \[0, 1\], got inf"),
    (dict(release_page_s=INF), r"release_page_s must be seconds in \[0, 1\], got inf"),
    (dict(release_page_s=-1e-6), r"release_page_s .* got -1e-06"),
    (dict(idle_release_s=NAN, elastic=False), r"idle_release_s .* got nan"),
    (dict(min_fraction="0.5"), r"min_fraction must be a number in \[0, 1\], got '0.5'"),
    (dict(min_fraction=True), r"min_fraction .* got True"),
    (dict(grow_fraction=1.5), r"grow_fraction .* got 1.5"),
    (dict(elastic="no"), r"elastic must be True or False, got 'no'"),
])
def test_a_shared_config_field_out_of_range_is_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        SharedConfig(**fields)


def test_a_budget_below_a_page_per_model_and_arrivals_out_of_range_are_refused():
    with pytest.raises(ConfigError, match=r"total_bytes=4194304 leaves 3 models less than one "
                                          r"page group each \(4194304 bytes: a page of "
                                          r"page_bytes=2097152 for each member of the pool\)"):
        SharedSimulator({n: [] for n in "abc"}, SharedConfig(total_bytes=4 * 2**20))
    for arrival in (NAN, -5.0, INF):
        with pytest.raises(ConfigError, match=rf"workload 'b': an arrival at {arrival!r} s"):
            simulate_shared({"a": [TraceEntry(10, 10, 0.0)], "b": [TraceEntry(10, 10, arrival)]},
                            SharedConfig(total_bytes=4 * GB))


@pytest.mark.parametrize("elastic", [True, False])
def test_a_budget_whose_page_tables_exceed_the_host_is_refused_naming_the_pages(elastic):
    """10**15 bytes of 4 KiB pages: each model's manager builds a table entry per page up to
    its max, and the run was a bare MemoryError (or the OOM killer) before any turn."""
    from vmemkv.scheduler.sim_memory import SimulationTooLargeError
    pages = 2 * (10**15 if elastic else 10**15 // 2) // 4096
    with pytest.raises(SimulationTooLargeError, match=rf"on a pool of {pages:,} pages .* lower "
                                                      r"total_bytes or raise page_bytes"):
        simulate_shared({"a": [TraceEntry(10, 5, 0.0)], "b": [TraceEntry(10, 5, 0.0)]},
                        SharedConfig(total_bytes=10**15, page_bytes=4096, model="tiny",
                                     elastic=elastic))


@pytest.mark.parametrize("fields, message", [
    (dict(duration_s=INF), r"BurstySpec.duration_s must be finite seconds > 0, got inf"),
    (dict(duration_s=True), r"BurstySpec.duration_s .* got True"),
    (dict(duration_s=1e11), r"BurstySpec.duration_s must be <= 1e\+10 s"),
    (dict(duration_s=10, period_s=1e-9), r"BurstySpec.period_s=1e-09 makes 1e\+10 periods in "
                                         r"duration_s=10; at most 100,000"),
    (dict(period_s=NAN), r"BurstySpec.period_s .* got nan"),
    (dict(burst_rate=INF), r"BurstySpec.burst_rate must be finite requests/s >= 0, got inf"),
    (dict(quiet_rate=-1.0), r"BurstySpec.quiet_rate .* got -1.0"),
    (dict(duration_s=10, burst_rate=1e12), r"burst_rate=1000000000000.0, quiet_rate=2.0 over "
                                           r"duration_s=10 for 2 models may draw 2e\+13 "
                                           r"arrivals; at most 10,000,000"),
    (dict(seed=-1), r"BurstySpec.seed must be an int >= 0, got -1"),
    (dict(seed=1.5), r"BurstySpec.seed .* got 1.5"),
    (dict(models="ab"), r"BurstySpec.models must be a tuple of distinct names, got 'ab'"),
    (dict(models=("a", "a")), r"BurstySpec.models .* got \('a', 'a'\)"),
    (dict(burst_fraction=0), r"BurstySpec.burst_fraction must be in \(0, 1\], got 0"),
])
def test_a_bursty_spec_field_that_would_hang_or_exhaust_memory_is_refused_by_name(fields,
                                                                                  message):
    with pytest.raises(ConfigError, match=message):
        BurstySpec(**fields)


@pytest.mark.parametrize("shift", [NAN, INF, -5.0, True])
def test_a_shift_that_is_not_finite_seconds_from_zero_is_refused(shift):
    """NaN and inf were accepted (simulate_shared then hung), -5 gave negative arrivals."""
    with pytest.raises(ConfigError, match=rf"shifted_traces.shift_s must be finite seconds >= "
                                          rf"0, got {shift!r}"):
        shifted_traces({"a": "azure-code", "b": "azure-code"}, shift_s=shift, max_requests=3)


def test_a_shift_that_puts_the_last_trace_past_the_clocks_range_is_refused():
    with pytest.raises(ConfigError, match=r"shift_s=10000000000.0 shifts the last of 3 traces "
                                          r"past 1e\+10 s"):
        shifted_traces({"a": "azure-code", "b": "azure-code", "c": "azure-code"},
                       shift_s=1e10, max_requests=3)
