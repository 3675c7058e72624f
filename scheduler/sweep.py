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
workload_rng, arrival_rate, trace, rate_scale, max_requests. A key a policy does not use
(block_size for vmem, page_bytes and layout for the others) is normalised away, so the grid
never runs the same simulation twice. ``run_point`` is a plain top-level function of a dict, so
a process pool or a Ray cluster can run it.
"""
from __future__ import annotations

import itertools
import json
import os
import tomllib
from typing import Callable, Dict, Iterable, List, Optional

from .cliargs import parse_bytes
from .errors import ConfigError
from .geometry import PageGeometry
from .presets import get_model
from .scheduler import SchedulerConfig
from .simulator import SimConfig, simulate
from .traces import fit_to_length, load_trace
from .workload import WorkloadSpec, generate

PARAMS: Dict[str, object] = {
    "policy": "paged", "model": "llama-3-8b", "gpu": "h100", "cache_gb": 60.0,
    "block_size": 16, "page_bytes": 2 * 2**20, "layout": "per-layer", "watermark": 0.01,
    "watermark_scope": "growing", "preemption": "recompute", "swap_gb": 0.0,
    "max_running": 1024, "max_tokens_per_step": 8192, "prefill_mfu": None,
    "map_latency_us": 0.0, "paged_slowdown": 1.0, "max_len": 4096, "requests": 2000, "seed": 0,
    "workload_rng": "numpy", "arrival_rate": 0.0, "trace": None, "rate_scale": 1.0,
    "max_requests": None,
}
_UNUSED = {"block_size": lambda p: p != "paged", "page_bytes": lambda p: p != "vmem",
           "layout": lambda p: p != "vmem"}


def load_spec(path: str) -> dict:
    """The spec file as ``{"base": {...}, "grid": {...}}``; ConfigError naming the file and
    the bad key or value."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f) if path.endswith(".toml") else json.load(f)
    except (OSError, ValueError) as error:      # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"sweep spec {path}: {error}") from None
    if not isinstance(raw, dict) or set(raw) - {"base", "grid"}:
        raise ConfigError(f"sweep spec {path}: want tables [base] and [grid] only, got "
                          f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    spec = {"base": dict(raw.get("base", {})), "grid": dict(raw.get("grid", {}))}
    for table, values in spec.items():
        for key, value in values.items():
            if key not in PARAMS:
                raise ConfigError(f"sweep spec {path}: unknown key {table}.{key}; known: "
                                  f"{', '.join(PARAMS)}")
            if table == "grid" and (not isinstance(value, list) or not value):
                raise ConfigError(f"sweep spec {path}: grid.{key} must be a non-empty list, "
                                  f"got {value!r}")
    return spec


def expand(spec: dict) -> List[dict]:
    """Every point of the grid (full parameter dicts, normalised, duplicates dropped), in
    grid order; each point is checked (SimConfig) before anything runs."""
    keys = list(spec["grid"])
    points, seen = [], set()
    for values in itertools.product(*(spec["grid"][k] for k in keys)):
        point = {**PARAMS, **spec["base"], **dict(zip(keys, values))}
        if isinstance(point["page_bytes"], str):
            point["page_bytes"] = _size(point["page_bytes"])
        for key, unused in _UNUSED.items():
            if unused(point["policy"]):
                point[key] = PARAMS[key]
        frozen = json.dumps(point, sort_keys=True)
        if frozen not in seen:
            seen.add(frozen)
            sim_config(point)
            points.append(point)
    return points


def _size(text: str) -> int:
    import argparse
    try:
        return parse_bytes(text)
    except argparse.ArgumentTypeError as error:
        raise ConfigError(f"sweep spec: page_bytes {error}") from None


def sim_config(point: dict) -> SimConfig:
    """The SimConfig a point names (ConfigError naming the field when a value is bad)."""
    sched = SchedulerConfig(max_running=point["max_running"],
                            max_tokens_per_step=point["max_tokens_per_step"],
                            watermark=point["watermark"], preemption=point["preemption"])
    return SimConfig(policy=point["policy"], model=point["model"], device=point["gpu"],
                     cache_bytes=int(point["cache_gb"] * 1e9), max_seq_len=point["max_len"],
                     block_size=point["block_size"], page_bytes=point["page_bytes"],
                     layout=point["layout"], swap_bytes=int(point["swap_gb"] * 1e9),
                     scheduler=sched, prefill_mfu=point["prefill_mfu"],
                     map_latency_s=point["map_latency_us"] * 1e-6,
                     paged_slowdown=point["paged_slowdown"],
                     watermark_scope=point["watermark_scope"])


def entries_of(point: dict) -> list:
    """The workload a point names: its trace (rate-scaled, fitted to max_len) or a generated one."""
    if point["trace"]:
        entries = load_trace(point["trace"], rate_scale=point["rate_scale"],
                             max_requests=point["max_requests"])
        return fit_to_length(entries, point["max_len"])[0]
    return generate(WorkloadSpec(num_requests=point["requests"], max_total_len=point["max_len"],
                                 arrival_rate=point["arrival_rate"], seed=point["seed"],
                                 rng=point["workload_rng"]))


def unit_tokens(point: dict) -> Optional[int]:
    """Tokens per allocation unit: the paged block, the vmem page (group); None for the other
    policies (a reservation is per sequence, not a fixed unit)."""
    if point["policy"] == "paged":
        return point["block_size"]
    if point["policy"] == "vmem":
        return PageGeometry.of(get_model(point["model"]), point["page_bytes"],
                               point["layout"]).tokens_per_page
    return None


def used_params(point: dict) -> List[str]:
    """The parameters that matter to the point's policy (PARAMS less the normalised ones)."""
    return [k for k in PARAMS if not (k in _UNUSED and _UNUSED[k](point["policy"]))]


def run_point(point: dict) -> dict:
    """One simulation: the point's parameters, then every figure of its result (one row)."""
    figures = simulate(entries_of(point), sim_config(point)).to_dict()
    figures["policy_name"] = figures.pop("policy")      # the manager's name; "policy" is the spec's
    row = {k: point[k] for k in PARAMS}
    row["unit_tokens"] = unit_tokens(point)
    row.update(figures)
    return row


def run_local(points: List[dict], jobs: Optional[int] = None,
              on_done: Callable[[dict], None] = lambda row: None) -> List[dict]:
    """Rows of ``points`` (in point order) from a pool of ``jobs`` processes (default: the
    CPU count; 1: in this process)."""
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_done(run_point(p), on_done) for p in points]
    from concurrent.futures import ProcessPoolExecutor, as_completed
    rows: List[Optional[dict]] = [None] * len(points)
    with ProcessPoolExecutor(max_workers=min(jobs, len(points))) as pool:
        futures = {pool.submit(run_point, p): i for i, p in enumerate(points)}
        for future in as_completed(futures):
            rows[futures[future]] = _done(future.result(), on_done)
    return rows


def run_ray(points: List[dict], address: str,
            on_done: Callable[[dict], None] = lambda row: None) -> List[dict]:
    """Rows of ``points`` run as Ray tasks on the cluster at ``address`` (``ray.init``'s
    address: ``auto``, ``ray://host:10001``, or ``local`` for a new local instance)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'vmemkv[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    task = ray.remote(run_point)
    pending = {task.remote(p): i for i, p in enumerate(points)}
    rows: List[Optional[dict]] = [None] * len(points)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            rows[pending.pop(ref)] = _done(ray.get(ref), on_done)
    return rows


def _done(row: dict, on_done: Callable[[dict], None]) -> dict:
    on_done(row)
    return row


def tidy_columns(rows: Iterable[dict]) -> List[str]:
    """Every column of ``rows``, in first-seen order (parameters first)."""
    cols: Dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    return list(cols)
