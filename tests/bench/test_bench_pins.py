"""Pins on the benchmarks' figures, from given numbers (no timing): which way each ratio goes,
which column each layout's figure lands in, the unit of each figure, and what is flagged."""
import pytest
import torch

from vmemkv.benchmarks import summary
from vmemkv.benchmarks.attention_goals import speedups, target_check


def _timed(cache, ms, phase="decode", batch=8, ctx=2048, pct=60.0):
    return {"cache": cache, "phase": phase, "batch": batch, "ctx": ctx, "ms": ms,
            "limit": "read" if phase == "decode" else "matmul", "pct_limit": pct}


def test_speedup_is_paged_ms_over_vmem_ms_and_the_target_asks_1_5x_at_b8_ctx2k():
    rows = [_timed("vmem", 2.0), _timed("paged", 3.0),
            _timed("vmem", 4.0, batch=1, ctx=8), _timed("paged", 2.0, batch=1, ctx=8)]
    ratios = {(r["batch"], r["ctx"]): r["paged_over_vmem"] for r in speedups(rows)}
    assert ratios == {(8, 2048): 1.5, (1, 8): 0.5}          # > 1: vmem is faster
    target = target_check(speedups(rows), torch.device("cpu"))
    assert target["decode_b8_ctx2048_speedup"] == 1.5 and target["met"] is True
    assert target["min_speedup_anywhere"] == 0.5            # the slowest ratio, not the fastest
    rows[1]["ms"] = 2.8                                     # 1.4x: faster, but short of 1.5x
    assert target_check(speedups(rows), torch.device("cpu"))["met"] is False


def test_the_attention_summary_row_puts_each_layout_in_its_column_with_paged_over_vmem():
    results = [_timed("vmem", 2.0, pct=60.0), _timed("paged", 5.0, pct=24.0),
               _timed("vmem interleaved", 2.5, pct=48.0)]
    main, inter = summary.summary_rows({"attention": {"results": results}}, ("attention",))
    assert (main["vmem"], main["paged"], main["unit"]) == (2.0, 5.0, "ms")
    assert main["note"] == "paged/vmem 2.50x; 60% of measured read bw vs 24% of measured read bw"
    assert (inter["what"], inter["vmem"]) == ("decode b8 ctx2048 interleaved", 2.5)
    assert inter["note"].startswith("interleaved/per-layer 1.25x")


def test_memory_utilisation_is_a_percentage_in_the_column_of_its_policy():
    results = [{"label": f"{policy} 16", "tokens_per_unit": 16, "policy": policy,
                "held_utilization": held, "mean_end_waste_tokens": 7.5}
               for policy, held in (("paged", 0.875), ("vmem", 0.995))]
    paged, vmem = summary.summary_rows({"memory": {"results": results}}, ("memory",))
    assert (paged.get("paged"), paged.get("vmem"), paged["unit"]) == (87.5, None, "%")
    assert (vmem.get("vmem"), vmem.get("paged")) == (99.5, None)
    assert paged["note"] == "end waste 7.5 tok/seq"


def test_a_section_that_failed_is_reported_as_not_run_with_its_error():
    payload = {"alloc": {"error": "RuntimeError: boom", "wall_s": 0.5},
               "engine": {"skipped": "no engine", "wall_s": 0.0}}
    rows = summary.summary_rows(payload, ("alloc", "engine"))
    assert rows == [{"section": "alloc", "what": "not run", "note": "RuntimeError: boom"},
                    {"section": "engine", "what": "not run", "note": "no engine"}]


LIMITS = {"read_gb_per_s": 10.0, "copy_gb_per_s": 5.0, "matmul_gflop_per_s": 100.0,
          "read_torch_gb_per_s": 10.0, "threads": 1, "matmul_dtype": "float32", "matmul_n": 128}
TINY = ["--configs", "2x32", "--phases", "decode", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--repeats", "3", "--warmup", "0", "--flush-mib", "0",
        "--baselines", "reference", "--kv-cache-dtype", "auto", "bf16", "--device", "cpu"]


def _fixed_times(fns, device, warmup, repeats, between=None):
    """Call i: 1, 9 and 2 ms x (i + 1) (seconds): median 2, min 1, max 9, mean 4 (x (i + 1))."""
    return [[(i + 1) * s for s in (1e-3, 9e-3, 2e-3)] for i in range(len(fns))]


def _attention_run(monkeypatch, argv=TINY):
    from vmemkv.benchmarks import attention
    monkeypatch.setattr(attention.yardstick, "measure", lambda *a, **k: dict(LIMITS))
    monkeypatch.setattr(attention, "sample_times", _fixed_times)
    return attention.run(argv=list(argv))


def test_attention_rows_are_the_median_in_ms_and_count_k_and_v_at_their_stored_width(monkeypatch):
    payload = _attention_run(monkeypatch)
    by = {(r["cache"], r["kv_cache_dtype"], r["baseline"]): r
          for r in payload["results"] + payload["baselines"]}
    # calls in order: per kv dtype, per cache (vmem, paged), the fastest then the baseline
    order = [(cache, kv, baseline) for kv in ("auto", "bf16") for cache in ("vmem", "paged")
             for baseline in (False, True)]
    for i, key in enumerate(order):
        r, scale = by[key], i + 1
        expected_ms = (2.0 * scale, 1.0 * scale, 9.0 * scale)      # median, min, max
        assert (r["ms"], r["ms_min"], r["ms_max"]) == pytest.approx(expected_ms)
        element_bytes = 4 if key[1] == "auto" else 2
        kv_bytes = 2 * 2 * 32 * 2 * 16 * element_bytes       # K and V x batch x ctx x heads x dim
        assert r["kv_gb_per_s"] == pytest.approx(kv_bytes / (2e-3 * scale) / 1e9)
        assert r["pct_limit"] == pytest.approx(100 * r["kv_gb_per_s"] / LIMITS["read_gb_per_s"])
    assert {r["backend"] for r in payload["results"]} == {"cpu-varlen"}
    # baseline ms / its fastest's ms: > 1, the fastest wins
    assert [r["baseline_over_backend"] for r in payload["baseline_ratios"]] == pytest.approx([
        4.0 / 2.0, 8.0 / 6.0, 12.0 / 10.0, 16.0 / 14.0])
    (vmem_kv,) = [r for r in payload["kv_cache_dtype_speedups"] if r["cache"] == "vmem"]
    # "a/b": a's speed-up over b, b's ms / a's ms
    assert vmem_kv["speedup_over"] == pytest.approx(
        {"auto/bf16": 10.0 / 2.0, "bf16/auto": 2.0 / 10.0})


def test_a_backend_whose_output_differs_is_refused_before_anything_is_timed(monkeypatch):
    from vmemkv.benchmarks import attention
    real = attention.backend_of

    class OffByOne:
        def __init__(self, backend):
            self.backend = backend

        def forward(self, q, view):
            return self.backend.forward(q, view) + 1.0

    monkeypatch.setattr(attention, "backend_of",
                        lambda spec: OffByOne(real(spec)) if spec == "reference" else real(spec))
    with pytest.raises(AssertionError, match="not close") as refused:
        _attention_run(monkeypatch, TINY[:-5] + ["--device", "cpu"])
    # which output differs from which: the cache and backend of both
    assert str(refused.value).startswith("decode batch 2 ctx 32: vmem with reference differs "
                                         "from vmem with cpu-varlen: ")


def _fake_prefix_measure(seconds, answers):
    def measure(cache, eviction, work, device, warmup, repeats):
        return {"cache": cache, "eviction": eviction, "seconds": seconds[eviction],
                "answers": answers[(cache, eviction)], "hit_rate": 0.0, "computed": 0}
    return measure


def test_prefix_speedup_is_the_time_without_retention_over_the_time_with_it(monkeypatch):
    from vmemkv.benchmarks import prefix
    same = {(c, e): [[1, 2, 3]] for c in ("vmem", "paged") for e in ("off", "lru")}
    monkeypatch.setattr(prefix, "workload", lambda quick: {})
    monkeypatch.setattr(prefix, "measure", _fake_prefix_measure({"off": 3.0, "lru": 2.0}, same))
    rows = prefix.run(True, "cpu", 0, 1, policies=["lru"])
    assert [(r["cache"], r["eviction"], r["speedup"], r["tokens_equal"]) for r in rows] == [
        ("vmem", "off", 1.0, True), ("vmem", "lru", 1.5, True),
        ("paged", "off", 1.0, True), ("paged", "lru", 1.5, True)]


def test_prefix_retention_that_changes_the_greedy_tokens_is_refused(monkeypatch):
    from vmemkv.benchmarks import prefix
    answers = {(c, e): [[1, 2, 3]] for c in ("vmem", "paged") for e in ("off", "lru")}
    answers[("paged", "lru")] = [[1, 2, 4]]
    monkeypatch.setattr(prefix, "workload", lambda quick: {})
    monkeypatch.setattr(prefix, "measure", _fake_prefix_measure({"off": 3.0, "lru": 2.0}, answers))
    with pytest.raises(RuntimeError, match="paged: greedy tokens differ"):
        prefix.run(True, "cpu", 0, 1, policies=["lru"])


def test_the_yardstick_rows_give_read_copy_and_matmul_each_in_its_unit():
    y = dict(LIMITS, read_native_gb_per_s=9.5, fma_peak_gflop_per_s=200.0)
    rows = summary.summary_rows({"attention": {"yardsticks": y, "results": []}}, ("attention",))
    assert [(r["what"], r["vmem"], r["unit"]) for r in rows] == [
        ("read bandwidth", 10.0, "GB/s"), ("copy bandwidth", 5.0, "GB/s"),
        ("float32 matmul", 100.0, "GFLOP/s"), ("fp32 FMA peak", 200.0, "GFLOP/s")]
    assert rows[0]["note"] == "1 threads; best of sums: torch 10.0, native 9.5"


def test_the_summary_table_leaves_out_the_columns_no_row_fills():
    table = summary.format_summary([{"section": "engine", "what": "engine vmem", "vmem": 12.5,
                                     "unit": "tok/s"}])
    header = [c.strip() for c in table.splitlines()[0].split("|")]
    assert header == ["section", "what", "vmem", "unit"]
    assert table.splitlines()[2].split("|")[2].strip() == "12.500"


def test_median_seconds_is_the_median_of_the_timed_calls_after_untimed_warmups(monkeypatch):
    from vmemkv.benchmarks import common
    clock = {"now": 0.0, "calls": 0}
    durations = [100.0, 100.0, 1.0, 10.0, 2.0]        # two warm-ups, then three timed calls

    def call():
        clock["now"] += durations[clock["calls"]]
        clock["calls"] += 1
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["now"])
    assert common.median_seconds(call, warmup=2, repeats=3) == 2.0   # not the mean, 4.33
    assert clock["calls"] == 5


def test_a_result_file_that_cannot_be_written_leaves_the_earlier_one_whole(tmp_path, capsys):
    from vmemkv.benchmarks import common
    path = tmp_path / "result.json"
    common.write_json(str(path), {"ms": 1.5})
    with pytest.raises(TypeError):
        common.write_json(str(path), {"ms": object()})   # not JSON: fails half-way through
    assert path.read_text() == '{\n  "ms": 1.5\n}' and [p.name for p in tmp_path.iterdir()] == [
        "result.json"]
    assert capsys.readouterr().out == f"# wrote {path}\n"


def test_speedups_keep_each_kv_cache_dtype_apart_and_the_target_takes_fp32_kv_only():
    rows = [dict(_timed(cache, ms), dtype="float32", kv_cache_dtype=kv)
            for cache, kv, ms in (("vmem", "auto", 2.0), ("paged", "auto", 3.0),
                                  ("vmem", "bf16", 1.0), ("paged", "bf16", 1.0))]
    ratios = {r["dtype"]: r["paged_over_vmem"] for r in speedups(rows)}
    assert ratios == {"float32": 1.5, "float32/kv bf16": 1.0}
    target = target_check(speedups(rows), torch.device("cpu"))
    assert (target["decode_b8_ctx2048_speedup"], target["met"]) == (1.5, True)


def test_benchmark_tables_give_floats_three_decimals_and_align_every_column():
    from vmemkv.benchmarks.common import format_table
    assert format_table([{"ms": 1.23456, "batch": 8}, {"ms": 10.0, "batch": 32}],
                        ["ms", "batch"]).splitlines() == [
        "    ms | batch", "-------+------", " 1.235 |     8", "10.000 |    32"]


def test_a_section_ticks_the_progress_bar_up_to_its_units_not_past_them(monkeypatch, capsys):
    import io
    from vmemkv.benchmarks import alloc, suite

    def call(section, quick, device, progress, options=None):
        progress.tick("one")          # two of alloc's units ticked by the section itself
        progress.tick("two")
        return {"results": []}
    monkeypatch.setattr(suite, "_call", call)
    bar = suite.Progress(alloc.num_configs(True), enabled=False)
    suite.run_section("alloc", True, "cpu", bar, io.StringIO())
    assert bar.count == alloc.num_configs(True) == 3
