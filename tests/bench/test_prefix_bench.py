"""benchmarks/prefix.py and ``vmemkv bench --prefix-eviction``: tokens identical with retention
off and on, fewer tokens computed with it, and the speed-up reported as a ratio."""
import json
import os

from vmemkv.benchmarks import prefix
from vmemkv.cli import main


def test_prefix_benchmark_checks_tokens_and_reports_a_speedup_ratio(tmp_path, capsys):
    assert main(["bench", "--smoke", "--only", "alloc", "--no-plots", "--no-progress",
                 "--device", "cpu", "--threads", "1", "--out", str(tmp_path),
                 "--prefix-eviction", "lru"]) == 0
    assert "speedup" in capsys.readouterr().out
    with open(os.path.join(tmp_path, "prefix.json")) as f:
        rows = json.load(f)["rows"]
    assert [(r["cache"], r["eviction"]) for r in rows] == [
        ("vmem", "off"), ("vmem", "lru"), ("paged", "off"), ("paged", "lru")]
    for off, on in (rows[:2], rows[2:]):
        assert off["tokens_equal"] and on["tokens_equal"]
        assert on["hit_rate"] > off["hit_rate"] and on["computed"] < off["computed"]
        assert off["speedup"] == 1.0 and on["speedup"] > 0


def test_prefix_trace_rows_name_every_policy_and_layout():
    rows = prefix.trace_rows(20, [1.0])
    assert {(r["layout"], r["eviction"]) for r in rows} == {
        (layout, e) for layout in ("paged-16", "vmem interleaved") for e in ("off", "lru", "hits")}
    assert all(r["prefill_tokens"] > 0 and 0 <= r["hit_rate"] < 1 for r in rows)
