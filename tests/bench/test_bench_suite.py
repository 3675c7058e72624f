"""`vmemkv bench` pieces: well-formed JSON with the expected keys, plots written, a summary table.

Behaviour, not timing: every benchmark runs at a toy size (tiny heads, a few configurations,
one repeat) so the whole file stays well under a minute on a 2-core CPU.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from vmemkv.benchmarks import alloc, attention, memory, plots, smoke, suite
from vmemkv import cli

ENV_KEYS = {"device", "torch", "seed", "warmup", "repeats"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def tiny(monkeypatch):
    """Shrink every section's --quick configuration to a toy size (benchmarks/smoke.py)."""
    smoke.apply(monkeypatch.setattr)


def fake_engine(quick=False, out=None, device="cpu"):
    print("# fake engine")
    return {"environment": {}, "rows": [{"system": "vmem per-layer", "tok_s": 12.5, "map_share": 0.01},
                                        {"system": "transformers generate_batch", "tok_s": 10.0}]}


def finite_numbers(row: dict, keys) -> bool:
    return all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] >= 0 for k in keys)


def test_attention_rows_cover_both_layouts_and_phases_checked_against_each_other(tiny):
    payload = attention.run(quick=True, device="cpu")
    assert ENV_KEYS <= payload["environment"].keys() and "backends" in payload["environment"]
    rows = payload["results"]
    assert len(rows) == 2 * 2 * 2 * 2   # batches x contexts x phases x layouts
    assert {(r["cache"], r["phase"]) for r in rows} == {(l, p) for l in ("vmem", "paged")
                                                         for p in ("decode", "prefill")}
    for r in rows:
        assert r["checked"] and r["backend"] in ("sdpa", "cpu-varlen")
        assert finite_numbers(r, ["ms", "ms_min", "ms_max", "kv_gb_per_s", "pct_copy"])
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
    assert len(payload["speedups"]) == 8
    assert {"applies", "met", "decode_b8_ctx2048_speedup"} <= payload["target"].keys()
    json.dumps(payload)


def test_attention_caches_hold_the_same_kv_and_grow_interleaved():
    import torch
    args = attention.parse_args(["--quick", "--device", "cpu", "--contexts", "48", "--batches", "3",
                                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16"])
    gen = torch.Generator().manual_seed(0)
    vmem_cache, paged_cache = attention.build_caches(3, 48, args, torch.device("cpu"),
                                                     torch.float32, gen)
    try:
        for seq in range(3):
            kv, kp = vmem_cache.read(seq, 0, 48), paged_cache.read(seq, 0, 48)
            assert torch.equal(kv[0], kp[0]) and torch.equal(kv[1], kp[1])
        tables = [paged_cache.manager.block_table(seq) for seq in range(3)]
        assert tables[0][1] - tables[0][0] != 1   # requests' blocks interleave, as in a live pool
    finally:
        vmem_cache.close()
        paged_cache.close()


def test_alloc_reports_map_latency_and_mapper_wait_for_both_modes(tiny):
    payload = alloc.run(quick=True, pages=4, device="cpu")
    assert ENV_KEYS <= payload["environment"].keys()
    assert {r["page_size"] for r in payload["results"]} == {"4 KiB", "64 KiB", "2 MiB"}
    for r in payload["results"]:          # the spread of the repeats brackets the median
        assert r["map_unmap_us_min"] <= r["map_unmap_us"] <= r["map_unmap_us_max"]
    lock, = payload["lock"]               # the pool lock's price, one ratio from one run
    assert lock["locked_over_bare"] == pytest.approx(lock["locked_us"] / lock["bare_us"])
    modes = {r["mode"]: r for r in payload["mapper"]}
    assert set(modes) == {"inline", "background"}
    for r in modes.values():
        assert r["pages_mapped"] > 0 and finite_numbers(r, ["mapping_ms", "wait_ms", "loop_ms"])
        assert r["wait_ms_min"] <= r["wait_ms"] <= r["wait_ms_max"]
    assert modes["inline"]["wait_ms"] == modes["inline"]["mapping_ms"]   # inline: all mapping waits


def test_memory_rows_per_unit_with_utilisation_and_end_waste(tiny):
    payload = memory.run(quick=True)
    rows = payload["results"]
    assert [r["label"] for r in rows] == ["paged 16", "paged 128", "vmem per-layer 64 KiB",
                                          "vmem interleaved 2 MiB"]
    assert [r["tokens_per_unit"] for r in rows] == [16, 128, 32, 32]
    for r in rows:
        assert 0 < r["held_utilization"] <= 1 and 0 < r["kv_utilization"] <= 1
        assert finite_numbers(r, ["mean_end_waste_tokens", "mean_batch", "output_tokens_per_s"])
    assert rows[0]["mean_end_waste_tokens"] < rows[1]["mean_end_waste_tokens"]  # bigger unit, more waste
    assert payload["environment"]["requests"] == 40
    # every section's header names the kernel, the driver and the load (memory lacked them)
    assert {"kernel", "vmem_driver", "load_1min"} <= payload["environment"].keys()


def test_bench_quick_writes_one_json_with_every_section_plots_and_a_summary(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "load_engine", lambda: (fake_engine, None))
    out = tmp_path / "bench"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
    payload = json.loads((out / "bench.json").read_text())
    assert {"environment", "alloc", "attention", "memory", "engine", "summary", "plots", "wall_s"} <= payload.keys()
    assert payload["engine"]["rows"][0]["tok_s"] == 12.5
    assert {row["section"] for row in payload["summary"]} == set(suite.SECTIONS)
    engine_rows = [row for row in payload["summary"] if row["section"] == "engine"]
    assert [(r.get("vmem"), r.get("paged"), r.get("transformers")) for r in engine_rows] == [
        (12.5, None, None), (None, None, 10.0)]   # transformers' engine is not our paged layout
    names = sorted(os.path.basename(p) for p in payload["plots"])
    assert names == ["attention_latency.png", "mapper_overlap.png", "memory_utilisation.png"]
    for name in names:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    log = (out / "bench.log").read_text()
    assert "== engine" in log and "# fake engine" in log
    printed = capsys.readouterr().out
    assert "section" in printed and "decode b2 ctx64" in printed and "bench.json" in printed


def test_engine_section_is_skipped_with_the_reason_when_not_importable(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "load_engine", lambda: (None, "vmemkv.benchmarks.engine is not importable (test)"))
    payload = suite.run_suite(quick=True, out_dir=str(tmp_path), device="cpu", sections=("engine",),
                              plots=False, progress=False)
    assert payload["engine"]["skipped"] == "vmemkv.benchmarks.engine is not importable (test)"
    assert payload["summary"] == [{"section": "engine", "what": "not run",
                                   "note": "vmemkv.benchmarks.engine is not importable (test)"}]
    assert "engine section skipped" in (tmp_path / "bench.log").read_text()


def test_bench_kv_cache_dtype_reaches_the_engine_section(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(suite, "load_engine", lambda: (lambda **kw: seen.append(kw) or {}, None))
    assert cli.main(["bench", "--only", "engine", "--kv-cache-dtype", "fp8_e4m3", "--out",
                     str(tmp_path), "--no-progress", "--no-plots", "--device", "cpu"]) == 0
    assert seen == [dict(quick=False, out=None, device="cpu", kv_cache_dtype="fp8_e4m3")]


def test_a_failing_section_is_recorded_and_the_command_exits_1(tmp_path, monkeypatch):
    def boom(**kwargs):
        raise RuntimeError("kaput")
    monkeypatch.setattr(suite, "load_engine", lambda: (boom, None))
    code = cli.main(["bench", "--quick", "--only", "engine", "--out", str(tmp_path), "--no-progress"])
    assert code == 1
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["engine"]["error"] == "RuntimeError: kaput"


def test_load_engine_reports_missing_run(monkeypatch):
    import sys
    import types
    monkeypatch.setitem(sys.modules, "vmemkv.benchmarks.engine", types.ModuleType("vmemkv.benchmarks.engine"))
    run, why = suite.load_engine()
    assert run is None and "no run(" in why


def test_progress_falls_back_to_stderr_lines_without_tqdm(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "tqdm", None)   # import tqdm -> ImportError
    bar = suite.Progress(2)
    bar.tick("first")
    bar.tick("second")
    bar.close()
    assert capsys.readouterr().err.splitlines() == ["[1/2] first", "[2/2] second"]


def test_plots_skip_sections_without_data(tmp_path):
    assert plots.write_all({"attention": {"error": "x"}, "memory": {"results": []}}, str(tmp_path)) == []


def test_summary_table_is_aligned():
    rows = [{"section": "alloc", "what": "a", "vmem": 1.5, "unit": "µs"},
            {"section": "attention", "what": "decode b8", "vmem": 12.25, "paged": 20.0, "note": "x"}]
    lines = suite.format_summary(rows).splitlines()
    bars = [[i for i, ch in enumerate(line) if ch == "|"] for line in lines if "|" in line]
    assert all(b[:4] == bars[0][:4] for b in bars)


def test_bench_help_is_registered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_bad_thread_count_is_a_one_line_usage_error_naming_the_limit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--threads", "0", "--only", "memory"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"vmemkv bench: error: argument --threads: must be in [1, {os.cpu_count()}], got 0 "
        f"(this machine has {os.cpu_count()} CPUs)")


def test_summary_reports_the_spread_of_repeats_beside_each_median():
    payload = {"attention": {"results": [
        {"phase": "decode", "batch": 1, "ctx": 8, "cache": kind, "ms": ms, "ms_min": ms - 1,
         "ms_max": ms + 1, "pct_copy": 50.0} for kind, ms in (("vmem", 2.0), ("paged", 4.0))]},
        "engine": {"rows": [{"system": "vmem per-layer", "tok_s": 12.0, "tok_s_runs": [11.0, 12.0, 15.0]}]}}
    rows = suite.summary_rows(payload, ("attention", "engine"))
    assert [r["min-max"] for r in rows] == ["1.000-3.000 / 3.000-5.000", "11.000-15.000"]
    assert "min-max" in suite.format_summary(rows).splitlines()[0]


def test_a_busy_machine_is_warned_about_in_the_summary_and_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "load_engine", lambda: (fake_engine, None))
    monkeypatch.setattr(suite.os, "getloadavg", lambda: (10.0 * os.cpu_count(), 0.0, 0.0))
    assert cli.main(["bench", "--only", "engine", "--out", str(tmp_path), "--no-progress"]) == 0
    (warning,) = json.loads((tmp_path / "bench.json").read_text())["warnings"]
    assert f">= 0.5 x {os.cpu_count()} cores" in warning and "unreliable" in warning
    assert f"# WARNING: {warning}" in capsys.readouterr().out


def test_an_idle_machine_gets_no_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "load_engine", lambda: (fake_engine, None))
    monkeypatch.setattr(suite.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    payload = suite.run_suite(out_dir=str(tmp_path), device="cpu", sections=("engine",),
                              plots=False, progress=False)
    assert payload["warnings"] == [] and payload["interrupted"] is False


def test_a_ctrl_c_while_drawing_the_plots_still_writes_bench_json(tmp_path, monkeypatch):
    """Every section finished, then Ctrl-C landed in matplotlib: bench.json was lost (only
    bench.log written); now it is written whole, marked interrupted, every section in it."""
    import json

    from vmemkv.benchmarks import plots

    def interrupted(payload, out_dir, on_written):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_all", interrupted)
    code = cli.main(["bench", "--smoke", "--only", "memory", "--out", str(tmp_path),
                     "--no-progress"])
    assert code == 130
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["interrupted"] and "memory" in payload and payload["plots"] == []
