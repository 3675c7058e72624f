"""The simulator-speed benchmark's per-sequence-step column is CPU time, as the docs label it
(docs/simulation.md, "Simulator speed"): it is cpu_s / sequence-steps, whatever the wall clock
did. The clocks are replaced by fakes whose wall time runs 4x faster than CPU time (a machine
shared with other jobs), so a column computed from wall seconds would read 4x too high."""
import types

import pytest

from vmemkv.benchmarks import simulate as simulate_bench
from vmemkv.scheduler.workload import WorkloadSpec, generate

WALL_S_PER_READ = 2.0   # each read of the fake perf_counter advances it this much
CPU_S_PER_READ = 0.5    # each read of the fake process_time advances it this much


def _fake_clocks() -> types.SimpleNamespace:
    reads = {"wall": 0, "cpu": 0}

    def perf_counter() -> float:
        reads["wall"] += 1
        return reads["wall"] * WALL_S_PER_READ

    def process_time() -> float:
        reads["cpu"] += 1
        return reads["cpu"] * CPU_S_PER_READ

    return types.SimpleNamespace(perf_counter=perf_counter, process_time=process_time)


def test_us_per_sequence_step_column_is_cpu_seconds_over_sequence_steps(monkeypatch):
    monkeypatch.setattr(simulate_bench, "time", _fake_clocks())
    entries = generate(WorkloadSpec(num_requests=12))
    row = simulate_bench.bench(entries, "paged", "per-layer", cache_gb=20.0, repeats=3)
    assert row["wall_s"] == pytest.approx(WALL_S_PER_READ)
    assert row["cpu_s"] == pytest.approx(CPU_S_PER_READ)
    assert row["seq_steps"] > 0
    assert row["cpu_us_per_seq_step"] == pytest.approx(CPU_S_PER_READ / row["seq_steps"] * 1e6)
    assert row["cpu_us_per_seq_step"] * 4 == pytest.approx(row["wall_s"] / row["seq_steps"] * 1e6)
