"""PNG plots of a ``vmemkv bench`` run (matplotlib, Agg backend, no display needed).

    python -m vmemkv.benchmarks.plots bench_out/bench.json [--out bench_out]

- ``attention_latency.png``: attention ms against context, one panel per phase (decode,
  prefill); a colour per batch size, solid = vmem, dashed = paged; log-log.
- ``memory_utilisation.png``: held utilisation (live / (live + end waste)) against the
  allocation unit in tokens (paged block size, or tokens per vmem page), one line per layout;
  right panel: end waste in tokens per sequence.
- ``mapper_overlap.png``: mapping time and time waited for it, inline vs background mapper.
"""
from __future__ import annotations

import json
import os
from typing import Callable

from vmemkv.benchmarks.common import exit_status
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.result_files import write_atomic

COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def attention_latency(attention: dict, path: str) -> str | None:
    """ms vs context per (phase, batch, layout); None when there are no results."""
    rows = attention.get("results") or []
    if not rows:
        return None
    plt = _pyplot()
    phases = sorted({r["phase"] for r in rows}, key=["decode", "prefill"].index)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for colour, batch in zip(COLOURS, batches):
            for kind, style in (("vmem", "-"), ("paged", "--")):
                pts = sorted((r["ctx"], r["ms"]) for r in rows
                             if (r["phase"], r["batch"], r["cache"]) == (phase, batch, kind))
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=colour, label=f"{kind} b{batch}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="attention time (ms)",
               title=f"{phase} ({_qlen(rows, phase)} query tokens per request)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    env = attention.get("environment", {})
    fig.suptitle(f"attention, vmem (solid) vs paged (dashed) -- {env.get('device', '')}, "
                 f"{env.get('dtype', '')}, {env.get('backends', '')}", fontsize=9)
    return _save(fig, plt, path)


def _qlen(rows, phase) -> str:
    lens = sorted({r["query_len"] for r in rows if r["phase"] == phase})
    return ",".join(str(n) for n in lens)


def memory_utilisation(memory: dict, path: str) -> str | None:
    """Held utilisation and end waste vs tokens per unit, per layout."""
    rows = memory.get("results") or []
    if not rows:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {"paged (block)": [r for r in rows if r["policy"] == "paged"],
              "vmem per-layer (page)": [r for r in rows if r["policy"] == "vmem" and r["layout"] == "per-layer"],
              "vmem interleaved (page)": [r for r in rows if r["policy"] == "vmem" and r["layout"] == "interleaved"]}
    for (name, pts), colour, marker in zip(series.items(), COLOURS, "osD"):
        pts = sorted(pts, key=lambda r: r["tokens_per_unit"])
        if not pts:
            continue
        x = [r["tokens_per_unit"] for r in pts]
        left.plot(x, [100 * r["held_utilization"] for r in pts], marker=marker, color=colour, label=name)
        right.plot(x, [r["mean_end_waste_tokens"] for r in pts], marker=marker, color=colour, label=name)
        for r in pts:
            if r["policy"] == "vmem":
                size = r["page_bytes"]
                text = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
                left.annotate(text, (r["tokens_per_unit"], 100 * r["held_utilization"]), fontsize=6,
                              xytext=(3, -9 if r["layout"] == "per-layer" else 4), textcoords="offset points")
    left.set(xscale="log", xlabel="allocation unit (tokens per block / page)",
             ylabel="held utilisation, live / (live + end waste) (%)", title="utilisation")
    right.set(xscale="log", yscale="log", xlabel="allocation unit (tokens per block / page)",
              ylabel="end waste (tokens per sequence)", title="end-of-sequence waste")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    env = memory.get("environment", {})
    fig.suptitle(f"standard log-normal workload, {env.get('requests', '')} requests, "
                 f"{env.get('cache_gb', '')} GB cache, {env.get('model', '')}", fontsize=9)
    return _save(fig, plt, path)


def mapper_overlap(alloc: dict, path: str) -> str | None:
    """Bars: mapping ms and wait ms for the inline and the background mapper."""
    rows = alloc.get("mapper") or []
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    modes = [r["mode"] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["mapping_ms"] for r in rows], 0.4, label="mapping", color=COLOURS[0])
    ax.bar([x + 0.2 for x in xs], [r["wait_ms"] for r in rows], 0.4, label="step waited", color=COLOURS[1])
    ax.set_xticks(list(xs), modes)
    ax.set(ylabel=f"ms over {rows[0]['steps']} steps", title="page mapping: time spent vs time waited")
    ax.legend()
    return _save(fig, plt, path)


def _save(fig, plt, path: str) -> str:
    """The figure as a PNG at ``path``, whole or not at all; closed either way."""
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def write_all(payload: dict, out_dir: str,
              on_written: Callable[[str], None] = lambda path: None) -> list[str]:
    """Every plot the payload has data for; returns the paths written. ``on_written(path)`` is
    called as each file is in place, so a caller cut short (Ctrl-C) by a later plot still knows
    which files this run rewrote."""
    os.makedirs(out_dir, exist_ok=True)
    jobs = [(attention_latency, "attention", "attention_latency.png"),
            (memory_utilisation, "memory", "memory_utilisation.png"),
            (mapper_overlap, "alloc", "mapper_overlap.png")]
    written = []
    for plot, section, name in jobs:
        data = payload.get(section)
        if isinstance(data, dict) and "error" not in data:
            path = plot(data, os.path.join(out_dir, name))
            if path:
                written.append(path)
                on_written(path)
    return written


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench.json written by vmemkv bench")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: the JSON's)")
    args = parser.parse_args(argv)
    try:
        with open(args.json, encoding="utf-8") as f:
            payload = json.load(f)
    except OSError as error:
        parser.error(f"{args.json}: {error.strerror or error}")
    except ValueError as error:                  # json.JSONDecodeError, UnicodeDecodeError
        parser.error(f"{args.json}: not JSON ({error})")
    if not isinstance(payload, dict) or payload.get("benchmark") != "vmemkv bench":
        parser.error(f"{args.json}: not a bench.json written by vmemkv bench")
    written = write_all(payload, args.out or os.path.dirname(os.path.abspath(args.json)))
    for path in written:
        print(f"# wrote {path}")
    if not written:
        print(f"# no plots: {args.json} has no data for any of them "
              "(attention, memory, alloc missing, failed or empty)")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("plots", main))
