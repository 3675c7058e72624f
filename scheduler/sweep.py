"""Parameter sweeps: a grid of simulations run in parallel, one tidy row per point.

A spec is TOML (``.toml``) or JSON (``.json``) with two tables:

    [base]                      # values every point shares (optional)
    requests = 500
    trace = "azure-code"        # or leave it out: the generated standard workload
    [grid]                      # lists; every combination is one point
    policy = ["paged", "vmem", "mymodule:MyManager"]
    cache_gb = [20, 60]
    block_size = [16, 128]      # paged only
    page_bytes = ["2MiB", "64KiB"]   # vmem only (bytes or a size with a unit)
    layout = ["per-layer", "interleaved"]   # vmem only
    rate_scale = [1, 4, 16]     # trace; arrival_rate for a generated workload

Keys (``PARAMS``, defaults as ``vmemkv simulate``'s): policy, model, gpu, cache_gb, block_size,
page_bytes, layout, watermark, watermark_scope, preemption, swap_gb, max_running,
max_tokens_per_step, prefill_mfu, map_latency_us, paged_slowdown, max_len, requests, seed,
workload_rng, arrival_rate, trace, rate_scale, max_requests. A key a point does not use
(block_size for vmem, page_bytes and layout for the others; the generated workload's keys for a
trace and the trace's for a generated workload) is normalised away, so the grid never runs the
same simulation twice; a workload key no point uses, a key in both tables and a value a grid
list repeats (4 and 4.0) are refused (``sweep_spec.py``). A trace file's row carries its resolved
path and sha256 (``trace_path``, ``trace_sha256``). ``run_point`` is a plain top-level function
of a dict, so a process pool or a Ray cluster can run it.

Values are checked when the spec is read (``scheduler/sweep_spec.py``). A point that fails
while it runs becomes a row with its parameters and an ``error`` column, and the others go on.
Ctrl-C cancels every pending point at once and stops the workers running (they ignore SIGINT
themselves, so the interrupt reaches only the parent, which ends them).
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Dict, Iterable, List, Optional

from .errors import ConfigError
from .sim_memory import set_concurrent_simulations
from .simulator import simulate
from .sweep_spec import (DEFAULT_MAX_POINTS, PARAMS, count_points, expand, load_spec,  # noqa: F401
                         point_key, point_params, sim_config, unit_tokens, used_params,
                         workload_spec)
from .traces import fit_to_length, load_trace
from .workload import generate

OnDone = Callable[[dict], None]


def entries_of(point: dict) -> list:
    """The workload a point names: its trace (rate-scaled, fitted to max_len) or a generated one."""
    if point["trace"]:
        entries = load_trace(point["trace"], rate_scale=point["rate_scale"],
                             max_requests=point["max_requests"])
        return fit_to_length(entries, point["max_len"])[0]
    return generate(workload_spec(point))


def run_point(point: dict) -> dict:
    """One simulation: the point's parameters (and trace file), then every figure of its
    result (one row)."""
    figures = simulate(entries_of(point), sim_config(point)).to_dict()
    figures["policy_name"] = figures.pop("policy")      # the manager's name; "policy" is the spec's
    row = point_params(point)
    row["unit_tokens"] = unit_tokens(point)
    row.update(figures)
    return row


def point_row(point: dict) -> dict:
    """``run_point``, or the point's parameters and ``error`` ("Type: message") when it
    raises: one failing point never loses the others."""
    try:
        return run_point(point)
    except Exception as error:   # noqa: BLE001 -- reported in its row, the sweep goes on
        row = point_params(point)
        try:
            row["unit_tokens"] = unit_tokens(point)
        except Exception:   # noqa: BLE001
            row["unit_tokens"] = None
        row["error"] = f"{type(error).__name__}: {error}"
        return row


def _worker_start(workers: int) -> None:
    """Each worker: Ctrl-C is the parent's to handle (it ends the workers), and a worker
    whose parent dies (kill -9) is ended too rather than computing on alone (Linux); its
    simulations are checked against its share of the host's memory (scheduler/sim_memory.py)."""
    set_concurrent_simulations(workers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # not Linux: the worker ends when it next reports
        pass


def run_local(points: List[dict], jobs: Optional[int] = None,
              on_done: OnDone = lambda row: None) -> List[dict]:
    """Rows of ``points`` (in point order) from a pool of ``jobs`` processes (default: the
    CPU count; 1: in this process), ``on_done(row)`` as each finishes. An interrupt cancels
    the pending points and ends the running ones before it goes on up."""
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1 or len(points) <= 1:
        return [_done(point_row(p), on_done) for p in points]
    from concurrent.futures import ProcessPoolExecutor, as_completed
    rows: List[Optional[dict]] = [None] * len(points)
    workers = min(jobs, len(points))
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_start, initargs=(workers,))
    try:
        futures = {pool.submit(point_row, p): i for i, p in enumerate(points)}
        for future in as_completed(futures):
            rows[futures[future]] = _done(future.result(), on_done)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()
    return rows


def _stop(pool) -> None:
    """Cancel what has not started and end the workers now (Python 3.14 names this
    ``terminate_workers``; before it, the pool's processes are its ``_processes``, which
    ``shutdown`` forgets, so they are read first)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(10)


def connect_ray(address: str):
    """The ``ray`` module, connected to the cluster at ``address`` (``ray.init``'s address:
    ``auto``, ``ray://host:10001``, or ``local`` for a new local instance; again: the same
    connection); ConfigError naming the extra when Ray is not installed. ``vmemkv sweep``
    calls it before it touches its output folder."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'vmemkv[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    return ray


def run_ray(points: List[dict], address: str, on_done: OnDone = lambda row: None) -> List[dict]:
    """Rows of ``points`` run as Ray tasks on the cluster at ``address`` (``connect_ray``); an
    interrupt cancels the tasks not finished."""
    ray = connect_ray(address)
    task = ray.remote(point_row)
    pending = {task.remote(p): i for i, p in enumerate(points)}
    rows: List[Optional[dict]] = [None] * len(points)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rows[pending.pop(ref)] = _done(ray.get(ref), on_done)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return rows


def _done(row: dict, on_done: OnDone) -> dict:
    on_done(row)
    return row


def tidy_columns(rows: Iterable[dict]) -> List[str]:
    """Every column of ``rows``, in first-seen order (parameters first)."""
    cols: Dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    return list(cols)
