"""A sweep's outputs: the tidy table (CSV; Parquet too when pyarrow is installed) and plots.

- ``throughput_latency.png``: p90 TTFT and median TPOT (ms) against completed requests/s, one
  line per series (every varying parameter but the load: arrival_rate, rate_scale).
- ``utilisation_unit.png``: held utilisation (live / (live + end waste)) against the allocation
  unit in tokens (paged block, vmem page group), log x, one line per series (every varying
  parameter but the load and the unit sizes).
Plots need matplotlib (the ``bench`` extra); without it the table is still written and
``plots_unavailable`` says why there are no plots. Every file is written whole or not at all
(scheduler/result_files.py). Rows with an ``error`` are in the table (their figures empty) and
left out of the plots.
"""
from __future__ import annotations

import csv
import importlib.util
import os
from typing import Dict, List, Optional, Sequence, Tuple

from .result_files import atomic_open, write_atomic
from .sweep import PARAMS, tidy_columns, used_params

LOAD_KEYS = ("arrival_rate", "rate_scale")
UNIT_KEYS = ("block_size", "page_bytes")


def write_table(rows: Sequence[dict], out_dir: str) -> List[str]:
    """``sweep.csv`` (and ``sweep.parquet`` with pyarrow) in ``out_dir``; the paths written."""
    cols = tidy_columns(rows)
    path = os.path.join(out_dir, "sweep.csv")
    with atomic_open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    written = [path]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return written
    table = pa.table({c: [row.get(c) for row in rows] for c in cols})
    written.append(write_atomic(os.path.join(out_dir, "sweep.parquet"),
                                lambda tmp: pq.write_table(table, tmp)))
    return written


def series(rows: Sequence[dict], ignore: Tuple[str, ...]) -> Dict[str, List[dict]]:
    """Rows grouped by the parameters that vary across ``rows`` (less ``ignore``); label
    "key=value, ..." (or "all" when nothing else varies)."""
    varying = [k for k in PARAMS if k not in ignore and len({repr(r[k]) for r in rows}) > 1]
    groups: Dict[str, List[dict]] = {}
    for row in rows:
        used = used_params(row)
        label = ", ".join(f"{k}={row[k]}" for k in varying if k in used) or "all"
        groups.setdefault(label, []).append(row)
    return groups


def plots_unavailable() -> Optional[str]:
    """Why ``write_plots`` cannot draw here (matplotlib is missing: the line names the bench
    extra), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed: pip install 'vmemkv[bench]'"
    return None


def write_plots(rows: Sequence[dict], out_dir: str) -> List[str]:
    """The PNGs described above (those the rows can draw); needs matplotlib
    (``plots_unavailable``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = [_throughput_latency(plt, rows, os.path.join(out_dir, "throughput_latency.png"))]
    unit_rows = [r for r in rows if r.get("unit_tokens")]
    if unit_rows:
        written.append(_utilisation(plt, unit_rows, os.path.join(out_dir, "utilisation_unit.png")))
    return written


def _throughput_latency(plt, rows, path: str) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, group in series(rows, LOAD_KEYS).items():
        group = sorted(group, key=lambda r: r["request_throughput"])
        xs = [r["request_throughput"] for r in group]
        axes[0].plot(xs, [r["p90_ttft_ms"] for r in group], "o-", label=label)
        axes[1].plot(xs, [r["median_tpot_ms"] for r in group], "o-", label=label)
    for ax, what in zip(axes, ("p90 TTFT (ms)", "median TPOT (ms)")):
        ax.set_xlabel("completed requests / s")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("vmemkv sweep: throughput against latency")
    return _save(plt, fig, path)


def _utilisation(plt, rows, path: str) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, group in series(rows, LOAD_KEYS + UNIT_KEYS).items():
        group = sorted(group, key=lambda r: r["unit_tokens"])
        ax.plot([r["unit_tokens"] for r in group], [r["held_utilization"] for r in group],
                "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("allocation unit (tokens: paged block, vmem page group)")
    ax.set_ylabel("held utilisation (live / held)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    try:
        return write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
