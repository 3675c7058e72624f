"""Shared benchmark plumbing: the environment header, median timing, the busy-machine warning,
the simulated cache's --cache-gb check, aligned tables, JSON.
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


def busy_warnings(load_1min_start: float, cores: int | None = None,
                  echo: bool = True) -> list[str]:
    """The busy-machine warning (summary.busy_warning) for a run whose 1-minute load was
    ``load_1min_start`` when it began, judged on the higher of that and the load now: printed as
    ``# WARNING: ...`` when ``echo``, and returned for the JSON, so that a ratio of wall times
    measured on a shared CPU says so beside its figures, as ``vmemkv bench``'s summary does."""
    from vmemkv.benchmarks.summary import busy_warning
    warning = busy_warning(max(load_1min_start, os.getloadavg()[0]), cores)
    if warning is None:
        return []
    if echo:
        print(f"# WARNING: {warning}", flush=True)
    return [warning]


def check_sim_cache_gb(parser, cache_gb: float) -> None:
    """What ``vmemkv simulate`` refuses, before anything runs (``parser.error`` naming
    --cache-gb, exit 2): a cache no H100 holds beside the simulated model's weights, or one that
    cannot hold one sequence of the workload's longest (the simulator's ConfigError named
    ``cache_bytes``, after a table's header had printed; 1000 GB ran, an H100 with no limit)."""
    from vmemkv.scheduler.errors import ConfigError
    from vmemkv.scheduler.presets import get_model
    from vmemkv.scheduler.sim_config import SimConfig, check_deployment
    c = SimConfig()
    try:
        check_deployment(model=c.model, gpu=c.device, cache_gb=cache_gb, preemption="recompute",
                         swap_gb=0.0, policy="vmem", block_size=c.block_size,
                         max_len=c.max_seq_len, name=lambda key: "--" + key.replace("_", "-"))
    except ConfigError as error:
        parser.error(str(error))
    least = get_model(c.model).bytes_per_token * c.max_seq_len / 1e9
    if cache_gb < least:
        parser.error(f"--cache-gb {cache_gb:g} cannot hold one {c.max_seq_len}-token sequence of "
                     f"{c.model} ({least:.2f} GB)")


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
