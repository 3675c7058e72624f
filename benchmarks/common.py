"""Shared benchmark plumbing: the environment header, median timing, aligned tables, JSON.
Each script ends as ``vmemkv``'s commands do: its ``__main__`` line is
``exit_status(PROG, main)`` (vmemkv/cli.py ``command_status``): Ctrl-C one line and status 130,
SIGTERM one line and 143, a user's error (an ``--out`` that cannot be written: the OSError
names the path; a ConfigError; a missing extra) one line ``PROG: error: ...`` and status 2, no
traceback. ``DistinctValues`` (list flags that refuse a repeated value) lives in
scheduler/cliargs.py, beside the flag types, and is re-exported here."""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Sequence

from vmemkv.cli import command_status as exit_status  # noqa: F401 (each script's __main__ line)
from vmemkv.scheduler import result_files
from vmemkv.scheduler.cliargs import DistinctValues  # noqa: F401 (re-exported: it lives there)


def environment(seed: int, warmup: int, repeats: int, device: str = "cpu", **extra) -> dict:
    """What every benchmark prints first: the device it ran on, versions, seed, warm-up and
    repeat counts. ``device`` is a torch device string ("cpu", "cuda", "cuda:1")."""
    import torch
    env = {
        "device": torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda")
                  else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "seed": seed, "warmup": warmup, "repeats": repeats,
    }
    env.update(extra)
    return env


def print_environment(env: dict) -> None:
    print("# " + "  ".join(f"{key}={value}" for key, value in env.items()), flush=True)


def median_seconds(fn: Callable[[], None], warmup: int, repeats: int,
                   sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """One aligned line per row; floats get 3 significant decimals."""
    def cell(value):
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    widths = [max(len(col), *(len(cell(row.get(col, ""))) for row in rows)) for col in columns]
    lines = [" | ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.append(" | ".join(cell(row.get(col, "")).rjust(w) for col, w in zip(columns, widths)))
    return "\n".join(lines)


def flags_given(parser, args, dests) -> list:
    """The flags among ``dests`` (argparse dests) given a value other than their default, as
    ``--name``: what a run that would not read them refuses by name."""
    return [f"--{dest.replace('_', '-')}" for dest in dests
            if vars(args)[dest] != parser.get_default(dest)]


def write_json(path: str | None, payload: dict) -> None:
    """``payload`` at ``path`` (none when ``path`` is empty), whole or not at all."""
    if not path:
        return
    result_files.write_json(path, payload, indent=2)
    print(f"# wrote {path}")
