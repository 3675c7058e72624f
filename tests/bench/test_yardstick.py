"""The yardsticks attention rows are divided by (benchmarks/yardstick.py), and the attention
benchmark's use of them: every row reports its share of the right limit, both vmem layouts in
one run, the goals of issues 28 and 33. Toy sizes: figures mean nothing, only the plumbing and
the honesty checks are tested."""
from __future__ import annotations

import math

import pytest
import torch

from vmemkv.benchmarks import attention, attention_goals, smoke, suite, yardstick


def test_the_native_read_loop_reads_every_float_whatever_the_threads():
    read = yardstick.native_read_sum()
    x = torch.zeros(100_003)                      # no multiple of any vector block: a tail too
    spots = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:777]
    x[spots] = 1.0
    for threads in (1, 2, 3):
        assert read(x.data_ptr(), x.numel(), threads) == 777.0
    for where in (0, x.numel() - 1, 64 * 1000 + 5):
        one = torch.zeros(x.numel())
        one[where] = 1.0
        assert read(one.data_ptr(), one.numel(), 2) == 1.0


def test_the_fma_loop_runs_every_round_it_is_asked_for():
    """Each accumulator a (1 + t at first) becomes a * 0.999999 + 1e-7 each round: the sum it
    returns after R rounds matches that recurrence's closed form, so the rounds really ran."""
    fn = yardstick._native("vk_fma_peak", [yardstick.ctypes.c_int64, yardstick.ctypes.c_int])
    lanes = yardstick._native("vk_vector_lanes", [])
    lanes.restype = yardstick.ctypes.c_int
    m, c = (float(torch.tensor(x, dtype=torch.float32)) for x in (0.999999, 1e-7))   # as in C
    for rounds in (1_000, 300_000):
        want = sum((1.0 + t) * m ** rounds + c * (1 - m ** rounds) / (1 - m) for t in range(12))
        assert fn(rounds, 1) == pytest.approx(want * lanes(), rel=1e-3)
        assert fn(rounds, 2) == pytest.approx(2 * want * lanes(), rel=1e-3)   # every thread ran
    assert math.isfinite(yardstick.fma_peak(10_000, repeats=1))


def test_a_reader_that_skips_data_is_refused(monkeypatch):
    honest = yardstick.native_read_sum()
    monkeypatch.setattr(yardstick, "native_read_sum",
                        lambda: lambda ptr, n, threads: honest(ptr, n // 2, threads))
    with pytest.raises(AssertionError, match="native read sum .* it skipped data"):
        yardstick.read_bandwidth(torch.device("cpu"), 1 << 20, repeats=1)


def test_measure_reports_every_limit_and_reads_at_the_best_of_torch_and_native():
    y = yardstick.measure("cpu", nbytes=2 << 20, matmul_n=64, repeats=1, fma_rounds=10_000)
    for key in ("read_gb_per_s", "read_torch_gb_per_s", "read_native_gb_per_s",
                "read_numpy_gb_per_s", "copy_gb_per_s", "matmul_gflop_per_s",
                "fma_peak_gflop_per_s"):
        assert math.isfinite(y[key]) and y[key] > 0, key
    assert y["read_gb_per_s"] == max(y["read_torch_gb_per_s"], y["read_native_gb_per_s"])
    assert y["threads"] == torch.get_num_threads() and y["matmul_dtype"] == "float32"
    assert "read" in yardstick.describe(y) and "matmul" in yardstick.describe(y)


@pytest.fixture
def tiny(monkeypatch):
    smoke.apply(monkeypatch.setattr)


def test_attention_rows_report_their_share_of_read_or_matmul_and_time_both_vmem_layouts(tiny):
    payload = attention.run(quick=True, device="cpu", argv=[
        "--vmem-layout", "per-layer", "interleaved", "--layers", "3", "--baselines", "sdpa",
        "--dtype", "float32", "bfloat16"])
    y, rows = payload["yardsticks"], payload["results"]
    assert {(r["cache"], r["dtype"]) for r in rows} == {
        (c, d) for c in ("vmem", "vmem interleaved", "paged") for d in ("float32", "bfloat16")}
    for r in rows:
        limit = ("read", r["kv_gb_per_s"] / y["read_gb_per_s"]) if r["phase"] == "decode" else \
            ("matmul", r["gflop_per_s"] / y["matmul_gflop_per_s"])
        assert r["limit"] == limit[0] and r["pct_limit"] == pytest.approx(100 * limit[1])
    prefill = next(r for r in rows if (r["phase"], r["batch"], r["ctx"]) == ("prefill", 2, 64))
    visible = sum(64 - 8 + p + 1 for p in range(8))   # 8 new tokens after 56 cached, causal
    assert prefill["gflop_per_s"] * prefill["ms"] * 1e6 == pytest.approx(4 * 2 * 4 * 16 * visible)
    goals = payload["goals"]
    assert goals["decode_read"]["rows"] == 24 and goals["prefill_vs_sdpa"]["rows"] == 24
    assert goals["interleaved"]["rows"] == 0       # b8 ctx2k and b32 ctx4k were not run
    summary = [r["what"] for r in suite.summary_rows({"attention": payload}, ["attention"])]
    assert summary[:4] == ["read bandwidth", "copy bandwidth", "float32 matmul", "fp32 FMA peak"]
    for r in rows:
        assert r["pct_fma_peak"] == pytest.approx(100 * r["gflop_per_s"] / y["fma_peak_gflop_per_s"])
    assert {"decode b2 ctx64 interleaved", "decode b2 ctx64 bfloat16 interleaved"} <= set(summary)


def _row(cache, phase, batch, ctx, ms, pct):
    return {"cache": cache, "phase": phase, "batch": batch, "ctx": ctx, "ms": ms, "pct_limit": pct}


def test_goals_judge_decode_share_prefill_against_sdpa_and_interleaved_against_per_layer():
    rows = [_row("vmem", "decode", 8, 2048, 4.0, 85.0), _row("paged", "decode", 8, 2048, 4.4, 79.0),
            _row("vmem interleaved", "decode", 8, 2048, 4.5, 81.0),
            _row("vmem", "decode", 32, 4096, 30.0, 90.0),
            _row("vmem interleaved", "decode", 32, 4096, 36.0, 80.0)]
    vs_sdpa = [{"cache": "vmem", "phase": "prefill", "batch": 8, "ctx": 2048, "baseline": "sdpa",
                "baseline_over_backend": 1.3},
               {"cache": "paged", "phase": "prefill", "batch": 8, "ctx": 2048, "baseline": "sdpa",
                "baseline_over_backend": 0.97}]
    g = attention_goals.goals(rows, vs_sdpa)
    assert (g["decode_read"]["met"], g["decode_read"]["worst"]) == (False, ("paged float32 b8 ctx2048", 79.0))
    assert (g["prefill_vs_sdpa"]["met"], g["prefill_vs_sdpa"]["worst"][0]) == (False, "paged float32 b8 ctx2048")
    assert g["interleaved"]["values"] == {"float32 b8 ctx2048": 1.125, "float32 b32 ctx4096": 1.2}
    assert (g["interleaved"]["met"], g["interleaved"]["worst"]) == (False, ("float32 b32 ctx4096", 1.2))
    rows[-1]["ms"], rows[1]["pct_limit"], vs_sdpa[1]["baseline_over_backend"] = 34.0, 80.0, 1.0
    g = attention_goals.goals(rows, vs_sdpa)
    assert g["decode_read"]["met"] and g["prefill_vs_sdpa"]["met"] and g["interleaved"]["met"]
    assert g["fp8_over_fp32"] == {"rows": 0, "met": None, "worst": None, "values": {}}


def test_the_fp8_goals_compare_each_cache_and_size_with_its_own_fp32_and_bf16_rows(capsys):
    rows = [dict(_row("vmem", "decode", 8, 2048, ms, 50.0), kv_cache_dtype=kv)
            for kv, ms in (("auto", 4.0), ("bf16", 2.0), ("fp8_e4m3", 1.5))]
    rows += [dict(_row("paged", "decode", 32, 4096, ms, 50.0), kv_cache_dtype=kv)
             for kv, ms in (("auto", 33.0), ("bf16", 16.0), ("fp8_e4m3", 11.0))]
    rows.append(dict(_row("vmem", "decode", 8, 512, 0.1, 50.0), kv_cache_dtype="fp8_e4m3"))
    g = attention_goals.goals(rows, [])
    assert g["fp8_over_fp32"]["values"] == {"vmem b8 ctx2048": 4.0 / 1.5, "paged b32 ctx4096": 3.0}
    assert g["fp8_over_fp32"]["met"] and not g["fp8_over_bf16"]["met"]
    assert g["fp8_over_bf16"]["worst"] == ("vmem b8 ctx2048", 2.0 / 1.5)
    attention_goals.print_goals({"applies": False, "decode_b8_ctx2048_speedup": None}, g, 52.94)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "issue 30" in ln]
    assert lines == ["# goal: fp8_e4m3 decode >= 2.5x fp32 K/V (issue 30): met (2 rows; worst vmem "
                     "b8 ctx2048 2.67) at read 52.9 GB/s",
                     "# goal: fp8_e4m3 decode >= 1.6x bf16 K/V (issue 30): NOT met (2 rows; worst "
                     "vmem b8 ctx2048 1.33) at read 52.9 GB/s"]
