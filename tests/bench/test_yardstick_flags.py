"""The benchmarks' honesty checks, on given numbers (no timing): a decode row above 100% of its
run's measured read bandwidth is flagged, a load of half the cores is warned about, the mapper's
saving is measured against inline mapping, and the packed forward-only row is not called a limit."""
import json
import os

from vmemkv.benchmarks import alloc, attention, suite, summary
from vmemkv.benchmarks.attention_goals import over_yardstick, run_warnings


def row(pct_limit, limit="read", phase="decode", cache="vmem", ms=15.0):
    return {"cache": cache, "phase": phase, "backend": "cpu-varlen", "batch": 8, "ctx": 2048,
            "query_len": 1, "ms": ms, "kv_gb_per_s": 33.4, "gflop_per_s": 66.8, "limit": limit,
            "pct_limit": pct_limit, "pct_copy": 150.0, "pct_fma_peak": 20.0, "baseline": False}


def test_a_decode_row_above_its_measured_read_bandwidth_is_flagged_unreliable():
    over, under = row(199.0), row(95.0)
    assert over_yardstick(over) and not over_yardstick(under)
    assert "UNRELIABLE" in attention.fmt(over) and "UNRELIABLE" not in attention.fmt(under)
    # prefill is a share of torch's matmul, which a kernel may beat: never flagged
    assert not over_yardstick(row(100.4, limit="matmul", phase="prefill"))


def test_the_summary_flags_the_row_too():
    payload = {"attention": {"results": [row(199.0), row(120.0, cache="paged", ms=20.0)]}}
    (line,) = summary.summary_rows(payload, ("attention",))
    assert line["note"].count("UNRELIABLE") == 2 and "measured read" in line["note"]
    assert "199.0% of measured read bw UNRELIABLE" in line["note"]   # 100.3% is not shown as 100%


def test_load_of_half_the_cores_is_warned_about_and_below_it_is_not():
    assert summary.busy_warning(1.0, cores=2) is not None      # was silent up to 2.0
    assert summary.busy_warning(2.2, cores=2) is not None
    assert summary.busy_warning(0.99, cores=2) is None
    warnings = run_warnings([row(199.0), row(95.0)], load_1min=2.2, cores=2)
    assert len(warnings) == 2 and "2.20" in warnings[0] and "1 decode row" in warnings[1]
    assert "199%" in warnings[1] and run_warnings([row(95.0)], 0.5, cores=2) == []


def sample(mode, mapping_ms, wait_ms, loop_ms):
    return {"mode": mode, "attention": "cpu-varlen", "steps": 128, "tokens_per_step": 1,
            "pages_mapped": 2048, "mapping_ms": mapping_ms, "wait_ms": wait_ms, "loop_ms": loop_ms}


def test_the_mapper_saving_is_against_the_inline_wait_not_the_threads_own_mapping():
    shape = {"layers": 8, "batch": 16, "page_bytes": 64 << 10}
    runs = {False: [sample("inline", 31.5, 31.5, 5510.0)],
            True: [sample("background", 49.6, 21.5, 4867.0)]}
    inline, background = alloc.mapper_rows(runs, shape)
    # 31.5 -> 21.5 ms is 32% less wait; against the thread's own 49.6 ms it read as "57% hidden"
    assert round(background["wait_saved_pct"], 1) == 31.7 and inline["wait_saved_pct"] == 0.0
    assert "hidden_pct" not in background
    assert round(inline["mapping_pct_of_loop"], 2) == 0.57
    note = summary.summary_rows({"alloc": {"mapper": [inline, background]}}, ("alloc",))[1]["note"]
    assert note.startswith("32% of inline's wait saved")


def test_the_packed_forward_row_is_not_called_a_limit():
    rows = summary.summary_rows({"engine": {"rows": [
        {"system": "model forward only (packed batch)", "tok_s": 2800.0}]}}, ("engine",))
    assert "limit" not in rows[0]["note"] and "not a bound" in rows[0]["note"]


def test_the_suite_warns_of_attention_rows_above_the_measured_read(tmp_path, monkeypatch):
    monkeypatch.setattr(suite.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    payload = {"environment": {"load_1min": 0.0}, "attention": {"results": [row(199.0), row(95.0)]}}
    suite._finish(payload, ("attention",), str(tmp_path))
    (warning,) = json.loads((tmp_path / "bench.json").read_text())["warnings"]
    assert warning.startswith("1 decode row(s) above 100%")
    monkeypatch.setattr(suite.os, "getloadavg", lambda: (0.5 * os.cpu_count(), 0.0, 0.0))
    suite._finish(payload, ("attention",), str(tmp_path))
    assert len(json.loads((tmp_path / "bench.json").read_text())["warnings"]) == 2
