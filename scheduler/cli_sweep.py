"""``vmemkv sweep SPEC``: a grid of simulations in parallel, one tidy table plus plots.

Local processes by default (``--jobs``, default the CPU count); ``--ray ADDRESS`` runs the
points as tasks on a Ray cluster instead (the ``ray`` extra). The spec format is in
``scheduler/sweep.py`` and docs/simulation.md. Writes OUT/sweep.rows.jsonl as points finish
(scheduler/sweep_journal.py), then OUT/sweep.csv (and sweep.parquet with pyarrow),
OUT/throughput_latency.png and OUT/utilisation_unit.png (matplotlib: without it, a line says
the plots were skipped and names the extra), each whole or not at all, and prints one line per
point. A point that fails is a row with its ``error`` (exit 1, the others kept); Ctrl-C
cancels the pending points, writes the table of those that finished (none: no table, and says
so) and exits 130; ``--resume`` runs only the points the journal does not hold. A grid of more
than ``--max-points`` combinations is refused before it is expanded; every check (the spec, each
point, ``--out``, ``--ray``) runs before the output folder is touched, so a refused run leaves
an earlier run's journal and files as they were.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, Optional

from .cliargs import bounded, max_threads, write_stdout
from .errors import ConfigError
from .progress import Progress
from .result_files import STALE_NAME, StaleMarker, folder_problem
from .sweep import (DEFAULT_MAX_POINTS, connect_ray, expand, load_spec, point_key, run_local,
                    run_ray)
from .sweep_journal import JOURNAL_NAME, RowJournal
from .sweep_output import plots_unavailable, write_plots, write_table

OUTPUTS = ("sweep.csv", "sweep.parquet", "*.png")


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of simulations in parallel (table + plots)",
                              description="Run every point of a sweep spec (TOML or JSON: [base] "
                                          "values and [grid] lists) through the simulator, in "
                                          "parallel; write a tidy table and plots.")
    p.add_argument("spec", metavar="SPEC", help="the sweep spec, .toml or .json (no default: required)")
    p.add_argument("--out", default="sweep_out", metavar="DIR",
                   help="folder for sweep.rows.jsonl, sweep.csv, sweep.parquet (with pyarrow) "
                        "and the PNGs (with matplotlib, the bench extra)")
    p.add_argument("--jobs", type=bounded(int, 1), default=None,
                   help=f"local worker processes, not with --ray (default: the CPU count, "
                        f"{max_threads()} here)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on the Ray cluster at ADDRESS (auto, ray://host:10001, local) "
                        "instead of local processes (default: local; needs vmemkv[ray])")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished rows of OUT/sweep.rows.jsonl and run only the "
                        "points it lacks (or whose row has an error) (default: run every point)")
    p.add_argument("--max-points", type=bounded(int, 1), default=DEFAULT_MAX_POINTS, metavar="N",
                   help="refuse a grid of more combinations than this, before expanding it")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args) -> int:
    if args.ray and args.jobs is not None:
        raise ConfigError(f"--jobs {args.jobs} sets the local worker processes and --ray "
                          f"{args.ray} runs the points on the Ray cluster instead: drop --jobs")
    spec = load_spec(args.spec)
    points = expand(spec, args.max_points)     # every point is checked before any runs
    problem = out_folder_problem(args.out, OUTPUTS + (JOURNAL_NAME,))
    if problem:
        raise ConfigError(f"--out {problem}")
    if args.ray:
        connect_ray(args.ray)        # Ray missing or unreachable: refused, the folder untouched
    marker = StaleMarker(args.out, OUTPUTS, "vmemkv sweep").begin()
    try:            # an error (a full disk) ends the run: STALE.txt says so (Ctrl-C: below)
        with RowJournal(args.out, points, args.resume) as journal:
            rows = dict(journal.kept)
            todo = [p for p in points if point_key(p) not in rows]
            interrupted = _run_points(args, todo, rows, journal, len(points))
        done = [rows[point_key(p)] for p in points if point_key(p) in rows]   # grid order
        written = write_table(done, args.out) if done else []
        finished = [r for r in done if not r.get("error")]
        plots_skipped = None
        if not (args.no_plots or interrupted) and finished:
            plots_skipped = plots_unavailable()
            written += [] if plots_skipped else write_plots(finished, args.out)
        for path in written:
            marker.wrote(path)
    except Exception as error:
        marker.failed(error)
        raise
    marker.finish("interrupted" if interrupted else None)
    if interrupted:
        raise KeyboardInterrupt(_interrupted(args.out, len(done), len(points), journal.path,
                                             marker.stale))
    _report(done, written, len(points) - len(todo), plots_skipped)
    return 1 if len(finished) < len(done) else 0


def _interrupted(out: str, done: int, total: int, journal: str, stale: Iterable[str]) -> str:
    """What an interrupted sweep wrote: its rows' table and journal, or, when no point had
    finished, no table at all (an earlier run's files stay, listed in STALE.txt)."""
    if done:
        return (f"wrote {done} of {total} rows to {os.path.join(out, 'sweep.csv')} (and "
                f"{journal}); --resume runs the rest")
    earlier = (f": {' and '.join(stale)} in {out} are an earlier run's (listed in "
               f"{os.path.join(out, STALE_NAME)})" if stale else "")
    return (f"no point had finished, so no table was written{earlier}; run the sweep again "
            f"to run its {total} points")


def out_folder_problem(path: str, names: Iterable[str] = ()) -> Optional[str]:
    """Why a run cannot write its files ``names`` into the folder ``path``
    (``result_files.folder_problem``), or None; an empty name is refused too (it passed the
    check as the current folder, then the run ended in ``FileNotFoundError: ... ''``).
    ``vmemkv bench --out`` checks the same, with its own names."""
    return "needs a folder name, got ''" if not path else folder_problem(path, names)


def _run_points(args, todo, rows: dict, journal: RowJournal, total: int) -> bool:
    """Run ``todo``, journaling each row as it finishes; True when Ctrl-C cut it short."""
    enabled = False if args.no_progress else None

    def done(row: dict) -> None:
        # the table's copy first: a Ctrl-C that lands while the journal line is being written
        # (fsync) must not leave a row on disk that the table and the count leave out; the
        # copy is the row as the journal holds it, so a resumed sweep writes the same table
        row = journal.journaled(row)
        rows[point_key(row)] = row
        journal.append(row)
        bar.update(1)
    try:
        with Progress(total, "sweep", enabled=enabled) as bar:
            bar.update(total - len(todo))
            if todo:
                run_ray(todo, args.ray, done) if args.ray else run_local(todo, args.jobs, done)
    except KeyboardInterrupt:
        return True
    return False


def _report(rows, written, resumed: int, plots_skipped: Optional[str] = None) -> None:
    """One line per row, then the files written (and why there are no plots, when that was
    not asked for), on stdout (a reader that closes it early, ``| head``, ends the listing
    quietly: the files are written already); failures, and each trace point's requests scaled
    down to its max_len (``scaled_requests``, as ``vmemkv simulate`` says them), on stderr."""
    lines = [_line(row) for row in rows]
    if resumed:
        lines.append(f"# {resumed} rows kept from the journal (--resume)")
    if plots_skipped:
        lines.append(f"# plots skipped: {plots_skipped}")
    for i, row in enumerate(rows, 1):          # old journals' rows have no scaled_requests
        if row.get("scaled_requests"):
            requests = row["num_requests"] + row["failed_requests"]   # every one ends
            sys.stderr.write(f"vmemkv sweep: point {i} ({' '.join(_head(row).split())}): "
                             f"{row['scaled_requests']:,} of {requests:,} trace requests were "
                             f"longer than max_len {row['max_len']} tokens and were scaled "
                             f"down to it\n")
    failed = [r for r in rows if r.get("error")]
    if failed:
        sys.stderr.write(f"vmemkv sweep: {len(failed)} of {len(rows)} points failed; their rows "
                         f"carry the error\n")
    write_stdout("".join(line + "\n" for line in lines + [f"# wrote {p}" for p in written]))


def _head(row: dict) -> str:
    """A row's policy, cache and allocation unit, as its line starts."""
    unit = f"unit {row['unit_tokens']:>5} tok" if row["unit_tokens"] else "unit     - tok"
    return f"{row['policy']:<16} {row['cache_gb']:>6g} GB {unit}  "


def _line(row: dict) -> str:
    head = _head(row)
    if row.get("error"):
        return head + f"FAILED: {row['error']}"
    held = row["held_utilization"]       # None: no step ended holding anything
    return (head + f"{row['output_tokens_per_s']:>9,.0f} tok/s  p90 TTFT {row['p90_ttft_ms']:>9,.0f} ms  "
            f"held util {'-' if held is None else format(held, '.1%'):>6}  "
            f"preempt {row['num_preemptions']:>5}")
