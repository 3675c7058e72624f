"""The goals ``benchmarks/attention.py`` checks at the end of a run, each from rows of that run.

* issue 4 (``target``, CPU fp32): decode b8 ctx2k, vmem >= 1.5x faster than paged.
* issue 33 (``goals["decode_read"]``): every decode row of the fastest backend at >= 80% of the
  read bandwidth measured in the same run; (``goals["prefill_vs_sdpa"]``) every prefill row of
  the fastest backend at least as fast as per-request ``sdpa`` on the same view (a baseline).
* issue 28 (``goals["interleaved"]``): decode on vmem interleaved within 15% of vmem per-layer
  at b8 ctx2k and b32 ctx4k (needs ``--vmem-layout per-layer interleaved``).
* issue 30 (``goals["fp8_over_fp32"]``, ``goals["fp8_over_bf16"]``): decode with fp8_e4m3 K/V
  under fp32 queries at b8 ctx2k and b32 ctx4k, on each cache, >= 2.5x faster than fp32 K/V
  and >= 1.6x than bf16 K/V (needs ``--kv-cache-dtype auto bf16 fp8_e4m3``).

A goal whose rows the run did not measure is reported with ``rows: 0`` and ``met: None``.

The yardsticks are what this run measured (benchmarks/yardstick.py), not hardware limits: on a
loaded machine the read bandwidth comes out low and decode rows then pass 100% of it.
``over_yardstick`` flags such a row and ``run_warnings`` says so, with the busy-machine warning
(summary.busy_warning: 1-minute load >= half the cores).
"""
from __future__ import annotations

TARGET = dict(phase="decode", batch=8, ctx=2048, speedup=1.5)  # issue 4, CPU fp32
DECODE_READ_PCT = 80.0
PREFILL_VS_SDPA = 1.0
INTERLEAVED_WITHIN = 1.15
GOAL_CONFIGS = ((8, 2048), (32, 4096))   # (batch, ctx) of issues 28 and 30's decode goals
FP8_OVER = {"auto": 2.5, "bf16": 1.6}   # issue 30: fp8_e4m3 decode's speed-up over these K/V


def over_yardstick(row: dict) -> bool:
    """A row above 100% of the read bandwidth its run measured: impossible for a true bound,
    so the yardstick (or the row) was disturbed and its share is unreliable. Prefill rows are
    shares of torch's matmul, which a kernel may beat, so they are never flagged."""
    return row.get("limit") == "read" and row.get("pct_limit", 0.0) > 100.0


def run_warnings(rows: list[dict], load_1min: float, cores: int | None = None) -> list[str]:
    """The run's warnings: the machine was busy (load >= half the cores), rows above 100%."""
    from vmemkv.benchmarks.summary import busy_warning
    over = [r for r in rows if over_yardstick(r)]
    return [w for w in (busy_warning(load_1min, cores),) if w] + (
        [f"{len(over)} decode row(s) above 100% of this run's measured read bandwidth (up to "
         f"{max(r['pct_limit'] for r in over):.0f}%): the yardstick was measured low, their "
         f"shares are unreliable"] if over else [])


def speedups(rows: list[dict]) -> list[dict]:
    """paged ms / vmem ms per (phase, batch, ctx, dtype): > 1 means vmem is faster."""
    by_key = {(r["phase"], r["batch"], r["ctx"], _dtype(r), r["cache"]): r["ms"] for r in rows}
    return [{"phase": p, "batch": b, "ctx": c, "dtype": d,
             "paged_over_vmem": by_key[(p, b, c, d, "paged")] / ms}
            for (p, b, c, d, kind), ms in by_key.items()
            if kind == "vmem" and (p, b, c, d, "paged") in by_key]


def _dtype(row: dict) -> str:
    """q's dtype, and the K/V's where a row stores another (``kv_cache_dtype``)."""
    kv = row.get("kv_cache_dtype", "auto")
    return row.get("dtype", "float32") + ("" if kv == "auto" else f"/kv {kv}")


def target_check(ratios: list[dict], device) -> dict:
    """Issue 4's CPU target: decode, batch 8, ctx 2k, fp32 -- vmem >= 1.5x paged, never slower."""
    ratios = [r for r in ratios if _dtype(r) == "float32"]
    hit = [r for r in ratios if (r["phase"], r["batch"], r["ctx"]) ==
           (TARGET["phase"], TARGET["batch"], TARGET["ctx"])]
    worst = min((r["paged_over_vmem"] for r in ratios), default=None)
    out = {"applies": device.type == "cpu" and bool(ratios),
           "decode_b8_ctx2048_speedup": hit[0]["paged_over_vmem"] if hit else None,
           "required_speedup": TARGET["speedup"], "min_speedup_anywhere": worst}
    out["met"] = bool(hit) and hit[0]["paged_over_vmem"] >= TARGET["speedup"]
    return out


def _goal(values: list[tuple[str, float]], ok, worst=min) -> dict:
    """``values``: (what, figure) per row the goal covers; met when ``ok(figure)`` for all;
    ``worst`` (min or max) picks the row furthest from it."""
    return {"rows": len(values), "met": all(ok(v) for _, v in values) if values else None,
            "worst": worst(values, key=lambda x: x[1]) if values else None,
            "values": dict(values)}


def goals(rows: list[dict], baseline_ratios: list[dict]) -> dict:
    """Issue 33's, 28's and 30's goals over one run's rows (see the module docstring)."""
    what = lambda r: f"{r['cache']} {_dtype(r)} b{r['batch']} ctx{r['ctx']}"  # noqa: E731
    decode = [(what(r), r["pct_limit"]) for r in rows if r["phase"] == "decode"]
    prefill = [(what(r), r["baseline_over_backend"]) for r in baseline_ratios
               if r["phase"] == "prefill" and r["baseline"] == "sdpa"]
    ms = {(r["cache"], r["batch"], r["ctx"], _dtype(r)): r["ms"] for r in rows
          if r["phase"] == "decode"}
    inter = [(f"{d} b{b} ctx{c}", ms[("vmem interleaved", b, c, d)] / ms[("vmem", b, c, d)])
             for d in sorted({_dtype(r) for r in rows}) for b, c in GOAL_CONFIGS
             if ("vmem interleaved", b, c, d) in ms and ("vmem", b, c, d) in ms]
    by_kv = {(r["cache"], r["batch"], r["ctx"], r.get("kv_cache_dtype", "auto")): r["ms"]
             for r in rows if r["phase"] == "decode" and r.get("dtype", "float32") == "float32"}
    fp8 = {other: [(f"{c} b{b} ctx{x}", by_kv[(c, b, x, other)] / t)
                   for (c, b, x, kv), t in by_kv.items() if kv == "fp8_e4m3"
                   and (b, x) in GOAL_CONFIGS and (c, b, x, other) in by_kv]
           for other in FP8_OVER}
    return {"fp8_over_fp32": _goal(fp8["auto"], lambda x: x >= FP8_OVER["auto"]),
            "fp8_over_bf16": _goal(fp8["bf16"], lambda x: x >= FP8_OVER["bf16"]),
            "decode_read": _goal(decode, lambda x: x >= DECODE_READ_PCT),
            "prefill_vs_sdpa": _goal(prefill, lambda x: x >= PREFILL_VS_SDPA),
            "interleaved": _goal(inter, lambda x: x <= INTERLEAVED_WITHIN, worst=max)}


def print_goals(target: dict, met: dict, read_gb_per_s: float | None = None) -> None:
    """One ``#`` line per goal the run measured; issue 30's with the run's read yardstick
    (``read_gb_per_s``), since they compare arithmetic-bound rows with memory-bound ones."""
    state = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    if target["applies"] and target["decode_b8_ctx2048_speedup"] is not None:
        print(f"# target (issue 4): decode b8 ctx2k vmem {target['decode_b8_ctx2048_speedup']:.2f}x "
              f"paged (need >= {TARGET['speedup']}): {state(target['met'])}; slowest ratio "
              f"anywhere {target['min_speedup_anywhere']:.2f}x")
    lines = {"decode_read": f"decode rows at >= {DECODE_READ_PCT:.0f}% of the measured read "
                            f"bandwidth (issue 33)",
             "prefill_vs_sdpa": "prefill rows >= 1.0x per-request sdpa (issue 33)",
             "interleaved": f"interleaved decode within {INTERLEAVED_WITHIN - 1:.0%} of per-layer "
                            f"at b8 ctx2k and b32 ctx4k (issue 28)",
             "fp8_over_fp32": f"fp8_e4m3 decode >= {FP8_OVER['auto']}x fp32 K/V (issue 30)",
             "fp8_over_bf16": f"fp8_e4m3 decode >= {FP8_OVER['bf16']}x bf16 K/V (issue 30)"}
    for key, text in lines.items():
        g = met[key]
        if g["rows"]:
            at = (f" at read {read_gb_per_s:.1f} GB/s" if key.startswith("fp8")
                  and read_gb_per_s is not None else "")
            print(f"# goal: {text}: {state(g['met'])} ({g['rows']} rows; worst {g['worst'][0]} "
                  f"{g['worst'][1]:.2f}){at}")
