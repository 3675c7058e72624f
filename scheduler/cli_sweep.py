"""``vmemkv sweep SPEC``: a grid of simulations in parallel, one tidy table plus plots.

Local processes by default (``--jobs``, default the CPU count); ``--ray ADDRESS`` runs the
points as tasks on a Ray cluster instead (the ``ray`` extra). The spec format is in
``scheduler/sweep.py`` and docs/simulation.md. Writes OUT/sweep.csv (and sweep.parquet with
pyarrow), OUT/throughput_latency.png and OUT/utilisation_unit.png (matplotlib), and prints one
line per point.
"""
from __future__ import annotations

import sys

from .cliargs import bounded, max_threads
from .progress import Progress
from .sweep import expand, load_spec, run_local, run_ray
from .sweep_output import write_plots, write_table


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of simulations in parallel (table + plots)",
                              description="Run every point of a sweep spec (TOML or JSON: [base] "
                                          "values and [grid] lists) through the simulator, in "
                                          "parallel; write a tidy table and plots.")
    p.add_argument("spec", metavar="SPEC", help="the sweep spec, .toml or .json (no default: required)")
    p.add_argument("--out", default="sweep_out", metavar="DIR",
                   help="folder for sweep.csv, sweep.parquet (with pyarrow) and the PNGs")
    p.add_argument("--jobs", type=bounded(int, 1), default=None,
                   help=f"local worker processes (default: the CPU count, {max_threads()} here)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on the Ray cluster at ADDRESS (auto, ray://host:10001, local) "
                        "instead of local processes (default: local; needs vmemkv[ray])")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args) -> int:
    points = expand(load_spec(args.spec))     # every point is checked before any runs
    enabled = False if args.no_progress else None
    with Progress(len(points), "sweep", enabled=enabled) as bar:
        done = lambda row: bar.update(1)     # noqa: E731
        rows = (run_ray(points, args.ray, done) if args.ray
                else run_local(points, args.jobs, done))
    written = write_table(rows, args.out)
    if not args.no_plots:
        written += write_plots(rows, args.out)
    for row in rows:
        sys.stdout.write(_line(row) + "\n")
    for path in written:
        sys.stdout.write(f"# wrote {path}\n")
    return 0


def _line(row: dict) -> str:
    unit = f"unit {row['unit_tokens']:>5} tok" if row["unit_tokens"] else "unit     - tok"
    return (f"{row['policy']:<16} {row['cache_gb']:>6g} GB {unit}  "
            f"{row['output_tokens_per_s']:>9,.0f} tok/s  p90 TTFT {row['p90_ttft_ms']:>9,.0f} ms  "
            f"held util {row['held_utilization']:>6.1%}  preempt {row['num_preemptions']:>5}")
