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
workload_rng, arrival_rate, trace, rate_scale, max_requests. A key a point does not use, by
``vmemkv simulate``'s rules for its flag (``unused_keys``: block_size outside paged, swap_gb
without swap preemption, the generated workload's keys for a trace, ...), is set to its default
there (``normalise``), so the grid never runs the same simulation twice; a key no point uses
(``check_used``), a key in both tables and a value a grid list repeats (4 and 4.0) are
refused (``sweep_spec.py``), as is a policy or trace file named two ways (``check_spellings``).
A trace file's row carries its resolved path and sha256 (``trace_path``, ``trace_sha256``), a
custom policy's those of its file or its module's file (``policy_path``, ``policy_sha256``:
``sweep_policy.py``). ``run_point`` is a plain top-level function of a dict, so a process pool
or a Ray cluster can run it.

A trace point's row counts, in ``scaled_requests``, the trace's requests longer than its
max_len, scaled down to it as ``vmemkv simulate`` does (None for a generated workload).

Values are checked when the spec is read (``scheduler/sweep_spec.py``). A point that fails
while it runs becomes a row with its parameters and an ``error`` column, and the others go on.
Ctrl-C cancels every pending point at once and stops the workers running (they ignore SIGINT
themselves, so the interrupt reaches only the parent, which ends them).
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .cli_checks import unused_flags
from .errors import ConfigError
from .sim_memory import set_concurrent_simulations
from .simulator import simulate
from .sweep_policy import sha256_of
from .sweep_spec import (DEFAULT_MAX_POINTS, PARAMS, TRACE_ID, TRACE_ONLY,  # noqa: F401
                         check_point, check_size, check_spec, count_points, load_spec, normal,
                         point_key, point_label, point_params, sim_config, trace_ids,
                         unit_tokens, workload_spec)
from .traces import fit_to_length, load_trace
from .workload import generate

OnDone = Callable[[dict], None]
# a key's ``vmemkv simulate`` flag (its dest), where the names differ; and the flags
# ``check_applies``' rules read that no sweep key sets, at simulate's defaults
FLAG_DEST = {"model": "model_preset", "page_bytes": "page_size"}
SIMULATE_ONLY = {"lora_adapters": 0, "beam_width": 0, "n": 1, "find_max_rate": False,
                 "seeds": None}


def expand(spec: dict, max_points: int = DEFAULT_MAX_POINTS) -> List[dict]:
    """Every point of the grid (full parameter dicts, each key a point does not use set to its
    default: ``normalise``; duplicates dropped), in grid order; the grid's size is bounded
    first, a key no point uses is refused (``check_used``), then each point is checked
    (``sweep_spec.check_point``) before anything runs."""
    check_spec(spec)
    check_size(spec, max_points)
    keys = list(spec["grid"])
    traces = trace_ids(spec)                  # each trace file read once, not once per point
    points, seen, used, where = [], set(), set(), {}
    for values in itertools.product(*(spec["grid"][k] for k in keys)):
        point = {**PARAMS, **spec["base"], **dict(zip(keys, values))}
        point["page_bytes"] = normal("page_bytes", point["page_bytes"])     # "2MiB": bytes
        unused = normalise(point)
        used.update(k for k in PARAMS if k not in unused)
        where.update(unused)
        point.update(traces.get(point["trace"], dict.fromkeys(TRACE_ID)))
        frozen = point_key(point)
        if frozen not in seen:
            seen.add(frozen)
            points.append((point, dict(zip(keys, values))))
    check_used(spec, used, where)
    built: set = set()
    latest_arrival_s: dict = {}
    for point, label in points:
        check_point(point, label, built, latest_arrival_s)
    check_spellings(points)
    return [point for point, _ in points]


def check_spellings(points: List[Tuple[dict, dict]]) -> None:
    """ConfigError when two (point, label) pairs are one simulation spelled two ways: a custom
    policy's file or a trace file named by two paths (``p.py:C`` and ``./p.py:C``, ``p:C`` and
    ``p.py:C``), keyed by what they resolve to (``simulation_key``). The grid would run it
    twice under two labels, as a list that repeats ``4`` and ``4.0`` would (refused too)."""
    first: Dict[str, dict] = {}
    for point, label in points:
        key = simulation_key(point)
        if key in first:
            files = [f"{what} file {point[what + '_path']}" for what in ("policy", "trace")
                     if point[what + "_path"] is not None]
            raise ConfigError(f"point {point_label(label)} is point {point_label(first[key])} "
                              f"spelled another way ({' and '.join(files)}): one simulation "
                              f"twice under two labels; list each once")
        first[key] = label


def simulation_key(point: dict) -> str:
    """``point_key`` with a custom policy named by its file and class (``POLICY_ID`` and the
    class name, not the spelling of its path or module) and a trace by its file alone."""
    resolved = dict(point)
    if point["policy_path"] is not None:
        resolved["policy"] = point["policy"].rpartition(":")[2]
    if point["trace_path"] is not None:
        resolved["trace"] = None
    return point_key(resolved)


def unused_keys(point: dict) -> Dict[str, str]:
    """Each key that does nothing at ``point`` -> where it applies: ``vmemkv simulate``'s rules
    for the key's flag (``cli_checks.unused_flags``: swap_gb without swap preemption, layout
    outside vmem, a generated workload's keys with a trace, ...), and the trace's keys
    (``TRACE_ONLY``) without one."""
    flags = {FLAG_DEST.get(k, k): point[k] for k in PARAMS}
    unused = unused_flags(argparse.Namespace(**SIMULATE_ONLY, **flags))
    keys = {k: unused[FLAG_DEST.get(k, k)][0] for k in PARAMS if FLAG_DEST.get(k, k) in unused}
    if point["trace"] is None:
        keys.update(dict.fromkeys(TRACE_ONLY, "to a trace"))
    return keys


def normalise(point: dict) -> Dict[str, str]:
    """Set each key ``point`` does not use to its default, so equal simulations have equal keys
    and rows, until none is left (a default can leave another key unused: watermark_scope for
    a reserve policy at watermark 0, then the watermark); ``unused_keys`` of the point as given."""
    unused = given = unused_keys(point)
    while True:
        changed = {k: PARAMS[k] for k in unused if point[k] != PARAMS[k]}
        if not changed:
            return given
        point.update(changed)
        unused = unused_keys(point)


def check_used(spec: dict, used: set, where: Dict[str, str]) -> None:
    """ConfigError naming each key the spec gives that no point uses, and where it applies
    (``vmemkv simulate`` refuses its flag in each of those runs; the points would be one
    simulation under several labels). A key some points use is kept at those and set to its
    default at the others (their rows say so)."""
    given = [f"{table}.{key} applies {where[key]}" for table in ("base", "grid")
             for key in spec[table] if key not in used]
    if given:
        raise ConfigError(f"{'; '.join(given)}: no point of the grid is such a run, so it "
                          f"would do nothing; leave it out")


def used_params(point: dict) -> List[str]:
    """The parameters that matter to the point (PARAMS less its ``unused_keys``)."""
    unused = unused_keys(point)
    return [k for k in PARAMS if k not in unused]


def entries_of(point: dict) -> Tuple[list, Optional[int]]:
    """The workload a point names, its trace (rate-scaled, fitted to max_len) or a generated
    one, and how many of the trace's requests were longer than max_len and scaled down to it
    (``traces.fit_to_length``; None for a generated workload)."""
    if point["trace"]:
        entries = load_trace(point["trace"], rate_scale=point["rate_scale"],
                             max_requests=point["max_requests"])
        check_trace_unchanged(point)
        return fit_to_length(entries, point["max_len"])
    return generate(workload_spec(point)), None


def check_trace_unchanged(point: dict) -> None:
    """ConfigError when the point's trace file (keyed by its sha256 when the sweep began:
    ``trace_ids``) has changed since: its row would name bytes it did not run (a line added
    while the sweep ran was simulated under the old file's sha256, and ``--resume`` kept that
    row for the old file). ``--resume`` runs it again with the file as it is then."""
    path, keyed = point["trace_path"], point["trace_sha256"]
    if path is None or path.startswith("bundled:"):
        return
    with open(point["trace"], "rb") as f:       # as load_trace opened it (a link's target now)
        now = sha256_of(f)
    if now != keyed:
        raise ConfigError(f"trace {point['trace']!r}: {path} changed since the sweep read it "
                          f"(sha256 {keyed[:12]}..., now {now[:12]}...): this point would run "
                          f"requests its row does not name; run it again (--resume runs the "
                          f"points whose trace changed)")


def run_point(point: dict) -> dict:
    """One simulation: the point's parameters (and trace file), its ``unit_tokens`` and
    ``scaled_requests`` (``entries_of``), then every figure of its result (one row)."""
    entries, scaled = entries_of(point)
    figures = simulate(entries, sim_config(point)).to_dict()
    figures["policy_name"] = figures.pop("policy")      # the manager's name; "policy" is the spec's
    row = point_params(point)
    row["unit_tokens"] = unit_tokens(point)
    row["scaled_requests"] = scaled
    row.update(figures)
    return row


def point_row(point: dict) -> dict:
    """``run_point``, or the point's parameters and ``error`` ("Type: message") when it
    raises: one failing point never loses the others, not even a custom policy that calls
    ``sys.exit`` (it ended the whole sweep, with no table; an interrupt still ends it)."""
    try:
        return run_point(point)
    except (Exception, SystemExit) as error:   # noqa: BLE001 -- in its row, the sweep goes on
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
