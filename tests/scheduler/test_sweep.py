"""`vmemkv sweep`: spec parsing, grid expansion, the local process pool, custom policies, Ray."""
import csv
import json
import os
from pathlib import Path

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.sweep import expand, load_spec, run_local, run_point
from vmemkv.scheduler.workload import TraceEntry, WorkloadSpec, generate, write_trace

CUSTOM = f"{Path(__file__).parent / 'custom_policy.py'}:CoarseBlocks"
SMALL = {"requests": 60, "cache_gb": 2}


def write(tmp_path, text: str, name: str = "spec.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_grid_expands_to_every_combination_without_duplicates(tmp_path):
    spec = load_spec(write(tmp_path, '[grid]\npolicy = ["paged", "vmem"]\nblock_size = [16, 64]\n'
                                     'page_bytes = ["2MiB", "64KiB"]\n'))
    points = expand(spec)
    # paged x 2 block sizes, vmem x 2 page sizes: unused keys are normalised away
    assert [(p["policy"], p["block_size"], p["page_bytes"]) for p in points] == [
        ("paged", 16, 2 * 2**20), ("paged", 64, 2 * 2**20),
        ("vmem", 16, 2 * 2**20), ("vmem", 16, 64 * 2**10)]


def test_json_spec_reads_like_toml(tmp_path):
    toml = load_spec(write(tmp_path, '[base]\nrequests = 10\n[grid]\ncache_gb = [1, 2]\n'))
    js = load_spec(write(tmp_path, json.dumps({"base": {"requests": 10}, "grid": {"cache_gb": [1, 2]}}),
                         "spec.json"))
    assert toml == js


@pytest.mark.parametrize("text,words", [
    ('[grid]\npolicy = "paged"\n', "non-empty list"),
    ('[grid]\ncolour = ["red"]\n', "unknown key grid.colour"),
    ('[extra]\na = 1\n', "[base] and [grid]"),
    ('[grid]\npolicy = ["lru"]\n', "policy"),
    ('[grid]\npage_bytes = ["3XB"]\n', "page_bytes"),
    ('[grid\n', "spec"),
])
def test_bad_spec_is_a_config_error_naming_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        expand(load_spec(write(tmp_path, text)))


def test_process_pool_rows_equal_in_process_rows():
    points = expand({"base": SMALL, "grid": {"policy": ["paged", "vmem"], "arrival_rate": [0, 4]}})
    pooled, serial = run_local(points, jobs=2), run_local(points, jobs=1)
    for row in pooled + serial:
        row.pop("wall_seconds")
    assert pooled == serial and len(pooled) == 4
    assert [r["policy"] for r in pooled] == ["paged", "paged", "vmem", "vmem"]


def test_pool_rows_come_in_point_order_whatever_order_they_finish_in():
    points = expand({"base": {"cache_gb": 2}, "grid": {"requests": [300, 3]}})
    rows = run_local(points, jobs=2)             # the 3-request point finishes first
    assert [(r["requests"], r["num_requests"]) for r in rows] == [(300, 300), (3, 3)]


def test_custom_policy_plugs_into_the_simulator():
    entries = generate(WorkloadSpec(num_requests=80, seed=3))
    sched = SchedulerConfig(watermark=0.01)
    custom = simulate(entries, SimConfig(policy=CUSTOM, cache_bytes=2 * 10**9, scheduler=sched))
    paged64 = simulate(entries, SimConfig(policy="paged", block_size=64, cache_bytes=2 * 10**9,
                                          scheduler=sched))
    assert custom.policy == "coarse-blocks"
    assert custom.simulated_seconds == paged64.simulated_seconds
    assert custom.mean_end_waste_tokens == paged64.mean_end_waste_tokens


@pytest.mark.parametrize("spec,words", [(CUSTOM.replace("CoarseBlocks", "NotAManager"), "MemoryManager"),
                                        ("no_such_module_xyz:Manager", "cannot import"),
                                        (":Manager", "module:Class")])
def test_bad_custom_policy_names_the_module_or_class(spec, words):
    with pytest.raises(ConfigError, match=words):
        SimConfig(policy=spec)


@pytest.mark.parametrize("source,words", [
    ("raise RuntimeError('boom')\n", r"importing .*raising_mod.py raised RuntimeError: boom"),
    ("def broken(:\n", r"raising_mod.py has a syntax error at .*raising_mod.py:1"),
])
def test_a_policy_module_that_raises_or_does_not_parse_is_a_config_error(tmp_path, source, words):
    path = tmp_path / "raising_mod.py"
    path.write_text(source)
    for _ in range(2):                   # not cached half-imported: the same error again
        with pytest.raises(ConfigError, match=words):
            SimConfig(policy=f"{path}:Manager")


def test_sweep_cli_writes_the_tidy_table_and_plots(tmp_path, capsys):
    spec = write(tmp_path, f'[base]\nrequests = 60\ncache_gb = 2\n[grid]\n'
                           f'policy = ["paged", "{CUSTOM}"]\narrival_rate = [2, 8]\n')
    out = tmp_path / "out"
    assert main(["sweep", spec, "--out", str(out), "--jobs", "2", "--no-progress"]) == 0
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["policy_name"] for r in rows} == {"paged", "coarse-blocks"}
    assert {"arrival_rate", "p90_ttft_ms", "steady_mean_batch", "unit_tokens"} <= set(rows[0])
    assert (out / "throughput_latency.png").stat().st_size > 0
    assert (out / "utilisation_unit.png").stat().st_size > 0
    assert "# wrote" in capsys.readouterr().out


def test_the_parquet_table_holds_the_csv_rows_column_for_column(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow (the test extra) is not installed")
    from vmemkv.scheduler.sweep_output import write_table
    rows = run_local(expand({"base": SMALL, "grid": {"policy": ["paged", "vmem"]}}), jobs=1)
    written = write_table(rows, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["sweep.csv", "sweep.parquet"]
    table = pq.read_table(tmp_path / "sweep.parquet").to_pylist()
    with open(tmp_path / "sweep.csv") as f:
        from_csv = list(csv.DictReader(f))
    assert len(table) == len(from_csv) == 2 and list(table[0]) == list(from_csv[0])
    for parquet_row, csv_row, row in zip(table, from_csv, rows):
        assert parquet_row == {c: row.get(c) for c in csv_row}      # typed, not strings
        assert {c: "" if v is None else str(v) for c, v in parquet_row.items()} == csv_row


def test_run_point_row_carries_parameters_then_figures():
    row = run_point(expand({"base": SMALL, "grid": {"policy": ["vmem"]}})[0])
    assert row["policy"] == "vmem" and row["unit_tokens"] == 1024
    assert row["output_tokens"] > 0 and "median_tpot_ms" in row


def test_a_trace_points_row_counts_its_requests_scaled_to_max_len(tmp_path):
    """scaled_requests: the trace's requests longer than max_len (None for a generated one)."""
    trace = str(tmp_path / "t.jsonl")
    write_trace(trace, [TraceEntry(3000, 10, 0.0), TraceEntry(100, 10, 0.5),
                        TraceEntry(2000, 100, 1.0)])
    row = run_point(expand({"base": {"trace": trace, "max_len": 2048, "cache_gb": 2},
                            "grid": {"policy": ["vmem"]}})[0])
    assert row["scaled_requests"] == 2 and row["num_requests"] == 3
    assert run_point(expand({"base": SMALL, "grid": {"policy": ["paged"]}})[0])[
        "scaled_requests"] is None


def test_ray_cluster_runs_the_same_rows_as_the_pool():
    ray = pytest.importorskip("ray")
    from vmemkv.scheduler.sweep import run_ray
    points = expand({"base": SMALL, "grid": {"policy": ["paged", "vmem"]}})
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        rows = run_ray(points, "local")
    finally:
        ray.shutdown()
    local = run_local(points, jobs=1)
    for row in rows + local:
        row.pop("wall_seconds")
    assert rows == local


def test_ray_path_without_ray_names_the_extra(monkeypatch):
    import sys
    from vmemkv.scheduler.sweep import run_ray
    monkeypatch.setitem(sys.modules, "ray", None)       # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"vmemkv\[ray\]"):
        run_ray([], "auto")
