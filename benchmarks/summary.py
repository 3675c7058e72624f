"""The summary table of ``vmemkv bench``: one row per headline figure, from the suite's payload.

Columns: section | what | vmem | paged | transformers | unit | min-max | note. ``vmem`` and
``paged`` are our two layouts; ``transformers`` is a figure of transformers' own engine
(``generate_batch``, its paged cache), never one of ours. Each number is the median of its
repeats; ``min-max`` gives the spread of those repeats (per column, ``/``-separated) where the
section recorded them. ``busy_warning`` says when the machine was too loaded for the ratios to
be trusted.
"""
from __future__ import annotations

import os
from typing import Optional

from vmemkv.benchmarks.attention_goals import over_yardstick

SUMMARY_COLUMNS = ("section", "what", "vmem", "paged", "transformers", "unit", "min-max", "note")
NUMERIC = ("vmem", "paged", "transformers")
TRANSFORMERS_LABEL = "transformers generate_batch"


def summary_rows(payload: dict, sections) -> list[dict]:
    """One row per headline figure of each section in ``sections`` present in ``payload``."""
    rows = []
    for section in sections:
        data = payload.get(section)
        if data is None:
            continue
        if "error" in data or "skipped" in data:
            rows.append({"section": section, "what": "not run", "note": data.get("error") or data["skipped"]})
            continue
        rows.extend(dict(section=section, **r) for r in _SUMMARISERS[section](data))
    return rows


def _spread(*ranges) -> str:
    """'lo-hi' per (lo, hi) pair, '/'-joined; empty when none was recorded."""
    parts = [f"{lo:.3f}-{hi:.3f}" for lo, hi in ranges if lo is not None and hi is not None]
    return " / ".join(parts)


def _alloc_summary(data: dict) -> list[dict]:
    rows = [{"what": f"{r['driver']} map+unmap {r['page_size']}", "vmem": r["map_unmap_us"],
             "unit": "µs/page", "min-max": _spread((r.get("map_unmap_us_min"), r.get("map_unmap_us_max")))}
            for r in data.get("results", [])]
    for r in data.get("mapper", []):
        saved = r.get("wait_saved_pct")
        rows.append({"what": f"mapper wait, {r['mode']}", "vmem": r["wait_ms"], "unit": "ms",
                     "min-max": _spread((r.get("wait_ms_min"), r.get("wait_ms_max"))),
                     "note": (f"{saved:.0f}% of inline's wait saved; "
                              if saved is not None and r["mode"] != "inline" else "") + f"of {r['mapping_ms']:.1f} ms mapping, {r['steps']} steps"})
    return rows


def _attention_summary(data: dict) -> list[dict]:
    """The yardsticks of the run, then per (phase, batch, ctx) vmem vs paged ms with each one's
    share of its yardstick (decode: the read bandwidth measured in this run; prefill: its matmul
    FLOP/s), and vmem interleaved where the run timed it."""
    rows = _yardstick_summary(data.get("yardsticks") or {})
    by_key = {(r["phase"], r["batch"], r["ctx"], r.get("dtype", "float32"), r["cache"]): r
              for r in data["results"]}
    for (phase, batch, ctx, dtype, layout), r in by_key.items():
        paged = by_key.get((phase, batch, ctx, dtype, "paged"))
        if layout != "vmem" or paged is None:
            continue
        what = f"{phase} b{batch} ctx{ctx}" + ("" if dtype == "float32" else f" {dtype}")
        rows.append({"what": what, "vmem": r["ms"], "paged": paged["ms"],
                     "unit": "ms", "min-max": _spread((r.get("ms_min"), r.get("ms_max")),
                                                      (paged.get("ms_min"), paged.get("ms_max"))),
                     "note": f"paged/vmem {paged['ms'] / r['ms']:.2f}x; {_share(r)} vs "
                     f"{_share(paged)}"})
        inter = by_key.get((phase, batch, ctx, dtype, "vmem interleaved"))
        if inter is not None:
            rows.append({"what": f"{what} interleaved", "vmem": inter["ms"],
                         "unit": "ms", "min-max": _spread((inter.get("ms_min"), inter.get("ms_max"))),
                         "note": f"interleaved/per-layer {inter['ms'] / r['ms']:.2f}x; {_share(inter)}"})
    return rows


def _share(row: dict) -> str:
    """'62% of measured read bw' (or matmul), flagged UNRELIABLE above 100% of the measured read
    (attention_goals.over_yardstick); rows from before the yardsticks: '% of copy bw'."""
    if "pct_limit" in row:
        over = over_yardstick(row)
        return (f"{row['pct_limit']:.{1 if over else 0}f}% of measured {row['limit']}"
                + (" bw" if row["limit"] == "read" else "") + (" UNRELIABLE" if over else ""))
    return f"{row['pct_copy']:.0f}% of copy bw"


def _yardstick_summary(y: dict) -> list[dict]:
    """The yardsticks the attention rows are divided by, measured in this run
    (benchmarks/yardstick.py): not hardware limits."""
    if not y:
        return []
    read = [f"{name} {y[f'read_{name}_gb_per_s']:.1f}" for name in ("torch", "native", "numpy")
            if f"read_{name}_gb_per_s" in y]
    threads = f"{y['threads']} threads"
    return [{"what": "read bandwidth", "vmem": y["read_gb_per_s"], "unit": "GB/s",
             "note": f"{threads}; best of sums: " + ", ".join(read)},
            {"what": "copy bandwidth", "vmem": y["copy_gb_per_s"], "unit": "GB/s",
             "note": f"{threads}; read + write counted"},
            {"what": f"{y['matmul_dtype']} matmul", "vmem": y["matmul_gflop_per_s"],
             "unit": "GFLOP/s", "note": f"{threads}; torch.mm n={y['matmul_n']}"}] + (
        [{"what": "fp32 FMA peak", "vmem": y["fma_peak_gflop_per_s"], "unit": "GFLOP/s",
          "note": f"{threads}; native loop, no memory"}] if "fma_peak_gflop_per_s" in y else [])


def _memory_summary(data: dict) -> list[dict]:
    rows = []
    for r in data["results"]:
        column = "paged" if r["policy"] == "paged" else "vmem"
        rows.append({"what": f"held util {r['label']} ({r['tokens_per_unit']} tok)", column:
                     100 * r["held_utilization"], "unit": "%",
                     "note": f"end waste {r['mean_end_waste_tokens']:.1f} tok/seq"})
    return rows


def engine_column(label: str) -> str:
    """Which column a system's tokens/s go in: transformers' own engine has its own; the
    packed forward-only row replays the vmem run's batches, so it goes with vmem."""
    if label.startswith("transformers") or " transformers " in label:   # also "<model> transformers ..."
        return "transformers"
    return "vmem" if "vmem" in label or label.startswith("model forward") else "paged"


def _engine_summary(data: dict) -> list[dict]:
    """tokens/s per system, in the column of its cache (transformers' engine in its own)."""
    rows = []
    for r in data.get("rows") or data.get("results") or []:
        label = str(r.get("system") or r.get("engine") or r.get("name") or "engine")
        value = r.get("tok_s", r.get("tokens_per_s"))
        if value is None:
            continue
        note = [f"{k} {r[k]:.1%}" for k in ("map_share", "attn", "overhead")
                if isinstance(r.get(k), float)]
        note += [f"{r['vs_hf']:.2f}x transformers"] if isinstance(r.get("vs_hf"), float) else []
        note += ["not a bound: the model's forward on [1, T] packed ids, T^2 attention"] \
            if label.startswith("model forward") else []
        runs = r.get("tok_s_runs") or []
        rows.append({"what": f"engine {label}", engine_column(label): float(value),
                     "unit": "tok/s", "min-max": _spread((min(runs), max(runs))) if len(runs) > 1 else "",
                     "note": "; ".join(note)})
    rows += _long_prompt_summary(data.get("long_prompts") or {})
    real = data.get("real_model") or {}
    if real.get("rows"):
        rows += _engine_summary({"rows": real["rows"]})
    elif real.get("skipped"):
        rows.append({"what": "engine SmolLM2-135M", "note": f"skipped: {real['skipped']}"})
    return rows or [{"what": "engine", "note": "no tokens/s figures; see bench.json"}]


def _tp_summary(data: dict) -> list[dict]:
    """tokens/s at TP=1 and TP=N (vmem per-layer), with the communication share of each step."""
    return [{"what": f"engine {r['system']}", "vmem": float(r["tok_s"]), "unit": "tok/s",
             "note": f"comm {r['comm_share']:.1%} of step" if r.get("comm_share") else ""}
            for r in data.get("rows", [])] or [{"what": "tp", "note": "no rows; see bench.json"}]


def _long_prompt_summary(data: dict) -> list[dict]:
    """Decode ITL p50 at 3-4k-token prompts, vmem and paged side by side, per backend."""
    by = {r["system"]: r["itl_p50_ms"] for r in data.get("rows", [])}
    return [{"what": f"ITL p50, 3-4k prompts, {attn}", "vmem": by[f"vmem {attn}"],
             "paged": by[f"paged {attn}"], "unit": "ms", "note": f"paged/vmem {ratio:.2f}x"}
            for attn, ratio in data.get("paged_over_vmem_itl", {}).items()
            if f"vmem {attn}" in by and f"paged {attn}" in by]


_SUMMARISERS = {"alloc": _alloc_summary, "attention": _attention_summary,
                "memory": _memory_summary, "engine": _engine_summary, "tp": _tp_summary}


BUSY_LOAD_PER_CORE = 0.5   # a 1-minute load of half the cores already moves the timings


def busy_warning(load_1min: float, cores: Optional[int] = None) -> Optional[str]:
    """A warning when the 1-minute load average was at least BUSY_LOAD_PER_CORE x the core
    count (timings then shared the CPU with other work, and so did the bandwidth yardsticks:
    ratios and shares of them are unreliable); else None."""
    cores = cores or os.cpu_count() or 1
    if load_1min < BUSY_LOAD_PER_CORE * cores:
        return None
    return (f"the machine was busy (1-min load average {load_1min:.2f} >= {BUSY_LOAD_PER_CORE} x "
            f"{cores} cores): timings and the measured yardsticks shared the CPU, ratios and "
            f"shares are unreliable; rerun on an idle machine")


def format_summary(rows: list[dict]) -> str:
    """Aligned table: numbers right-aligned (3 decimals), text left-aligned; columns no row
    fills are left out."""
    columns = [c for c in SUMMARY_COLUMNS
               if c in ("section", "what") or any(r.get(c) not in (None, "") for r in rows)]

    def cell(value):
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]

    def line(values):
        return " | ".join(v.rjust(w) if c in NUMERIC else v.ljust(w)
                          for c, v, w in zip(columns, values, widths)).rstrip()
    out = [line(columns), "-+-".join("-" * w for w in widths)]
    out.extend(line([cell(r.get(c, "")) for c in columns]) for r in rows)
    return "\n".join(out)
