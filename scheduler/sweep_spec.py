"""A sweep spec: its file, every value's type and range, the grid's size, each point's checks.

A spec is TOML (``.toml``) or JSON (``.json``) with two tables, ``[base]`` (values every point
shares) and ``[grid]`` (lists; every combination is one point); the format is in
``scheduler/sweep.py`` and docs/simulation.md. Every value is checked against ``KINDS`` when
the file is read (a string where a number goes, ``nan``, ``1e308`` GB, a float count: a
``ConfigError`` naming ``table.key[index]`` and the allowed range), an empty spec is refused,
workload keys that apply to no point are refused (``check_workload_keys``: they would run one
simulation under several labels), and ``count_points`` bounds the grid before anything is
expanded. A key in both tables is refused (the grid would silently win), and so is a grid list
that repeats a value (``4`` and ``4.0`` GB are one simulation: float keys are keyed as floats,
sizes in bytes; the point keeps the value as given). Each point (``sweep.expand``) is then
checked as ``vmemkv simulate`` checks its flags: the SimConfig, the generated workload or the
trace (``check_trace``), the deployment (``sim_config.check_deployment``) and its memory
manager, built once per distinct SimConfig.
A point that replays a trace file is keyed by the file's resolved path and the sha256 of its
bytes (``TRACE_ID``, read once per file per sweep), so ``--resume`` runs again the points of a
trace that changed; a point whose policy is custom (``file.py:Class`` or ``module:Class``) likewise
by its file's resolved path and sha256 (``POLICY_ID``, scheduler/sweep_policy.py), so an edited
policy runs again (a journal row from before these were keyed has none, and its point runs
again too).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Dict, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:                        # Python 3.10: the same parser, as the tomli dependency
    import tomli as tomllib

from .cliargs import parse_bytes
from .errors import ConfigError
from .geometry import LAYOUT_CHOICES, PageGeometry
from .policies import is_custom
from .presets import DEVICES, MODELS
from .scheduler import PREEMPTION_MODES, SchedulerConfig
from .sim_config import WATERMARK_SCOPES, check_deployment
from .sim_memory import check_host_need   # the pool alone: no request drawn yet
from .sim_memory import pool_unit_bytes, simulation_bytes
from .simulator import SimConfig
from .sweep_policy import POLICY_ID, check_policy_unchanged, policy_id, sha256_of  # noqa: F401
from .trace_entry import object_once   # a JSON key given twice: refused, not the later kept
from .traces import BUNDLED, load_trace
from .workload import MAX_ARRIVAL_S, WORKLOAD_RNGS, WorkloadSpec

PARAMS: Dict[str, object] = {
    "policy": "paged", "model": "llama-3-8b", "gpu": "h100", "cache_gb": 60.0,
    "block_size": 16, "page_bytes": 2 * 2**20, "layout": "per-layer", "watermark": 0.01,
    "watermark_scope": "growing", "preemption": "recompute", "swap_gb": 0.0,
    "max_running": 1024, "max_tokens_per_step": 8192, "prefill_mfu": None,
    "map_latency_us": 0.0, "paged_slowdown": 1.0, "max_len": 4096, "requests": 2000, "seed": 0,
    "workload_rng": "numpy", "arrival_rate": 0.0, "trace": None, "rate_scale": 1.0,
    "max_requests": None,
}
GENERATED_ONLY = ("requests", "arrival_rate", "seed", "workload_rng")   # a generated workload's
TRACE_ONLY = ("rate_scale", "max_requests")                              # a trace's
TRACE_ID = ("trace_path", "trace_sha256")   # a trace point's file, in its key and its row
DEFAULT_MAX_POINTS = 10_000


@dataclass(frozen=True)
class Kind:
    """What one key takes: "str", "int" or "float" (an int is a float too), inside
    [low, high] (``low_open``: above low), ``None`` when ``optional``, a size with a unit
    ("2MiB", checked when the point is built) when ``size``."""
    type: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    optional: bool = False
    size: bool = False
    choices: tuple = ()

    def check(self, value, where: str) -> None:
        if value is None and self.optional:
            return
        if self.type == "str" or (self.size and isinstance(value, str)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
            if self.choices and value not in self.choices:
                raise ConfigError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
            return
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (self.type == "int" and not isinstance(value, int)):
            raise ConfigError(f"{where} must be {self._want()}, got {value!r}")
        if not math.isfinite(value) or (self.low is not None and (
                value <= self.low if self.low_open else value < self.low)) \
                or (self.high is not None and value > self.high):
            raise ConfigError(f"{where} must be {self._want()}, got {value!r}")

    def _want(self) -> str:
        what = "an int" if self.type == "int" else "a finite number"
        low = "" if self.low is None else f" {'>' if self.low_open else '>='} {_num(self.low)}"
        high = "" if self.high is None else f" and <= {_num(self.high)}"
        size = " (or a size such as '2MiB')" if self.size else ""
        return what + low + high + size + (" (or null)" if self.optional else "")


def _num(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


_GB, _COUNT = 1e6, 10**7      # a petabyte; ten million requests, tokens or sequences
KINDS: Dict[str, Kind] = {
    "policy": Kind("str"), "model": Kind("str", choices=tuple(sorted(MODELS))),
    "gpu": Kind("str", choices=tuple(sorted(DEVICES))), "layout": Kind("str", choices=LAYOUT_CHOICES),
    "watermark_scope": Kind("str", choices=WATERMARK_SCOPES),
    "preemption": Kind("str", choices=PREEMPTION_MODES),
    "workload_rng": Kind("str", choices=WORKLOAD_RNGS),
    "trace": Kind("str", optional=True),
    "cache_gb": Kind("float", 0, _GB, low_open=True), "swap_gb": Kind("float", 0, _GB),
    "watermark": Kind("float", 0, 1), "prefill_mfu": Kind("float", 0, 1, True, optional=True),
    "map_latency_us": Kind("float", 0, 1e9), "paged_slowdown": Kind("float", 1, 1e6),
    "arrival_rate": Kind("float", 0, 1e9), "rate_scale": Kind("float", 0, 1e9, True),
    "block_size": Kind("int", 1, 2**20), "page_bytes": Kind("int", 1, 2**40, size=True),
    "max_running": Kind("int", 1, _COUNT), "max_tokens_per_step": Kind("int", 1, 10**9),
    "max_len": Kind("int", 2, _COUNT), "requests": Kind("int", 1, _COUNT),
    "seed": Kind("int", 0, 2**63 - 1), "max_requests": Kind("int", 1, _COUNT, optional=True),
}


def load_spec(path: str) -> dict:
    """The spec file as ``{"base": {...}, "grid": {...}}``, every value checked; ConfigError
    naming the file and the bad key or value."""
    try:
        with open(path, "rb") as f:
            raw = (tomllib.load(f) if path.endswith(".toml")
                   else json.load(f, object_pairs_hook=object_once))
    except (OSError, ValueError, RecursionError) as error:   # bad TOML/JSON, nested too deep
        why = "nested too deeply" if isinstance(error, RecursionError) else error
        raise ConfigError(f"sweep spec {path}: {why}") from None
    if not isinstance(raw, dict) or set(raw) - {"base", "grid"}:
        raise ConfigError(f"sweep spec {path}: want tables [base] and [grid] only, got "
                          f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    spec = {"base": raw.get("base", {}), "grid": raw.get("grid", {})}
    try:
        check_spec(spec)
    except ConfigError as error:
        raise ConfigError(f"sweep spec {path}: {error}") from None
    return {table: dict(values) for table, values in spec.items()}


def check_spec(spec: dict) -> None:
    """ConfigError naming the first key or value that is not allowed."""
    for table, values in spec.items():
        if not isinstance(values, dict):
            raise ConfigError(f"[{table}] must be a table of keys, got {values!r}")
    if not spec["base"] and not spec["grid"]:
        raise ConfigError("the spec is empty: give [grid] lists (and [base] values)")
    for table, values in spec.items():
        for key, value in values.items():
            if key not in PARAMS:
                raise ConfigError(f"unknown key {table}.{key}; known: {', '.join(PARAMS)}")
            if table == "base":
                KINDS[key].check(value, f"base.{key}")
                normal(key, value, f"base.{key}")          # a size with a unit parses
                continue
            if not isinstance(value, list) or not value:
                raise ConfigError(f"grid.{key} must be a non-empty list, got {value!r}")
            check_grid_list(key, value)
    for key in spec["base"]:
        if key in spec["grid"]:
            raise ConfigError(f"{key} is in both [base] and [grid]: the grid's values would "
                              f"replace base.{key} = {spec['base'][key]!r} at every point; "
                              f"give it in one table")
    check_workload_keys(spec)


def check_grid_list(key: str, values: list) -> None:
    """Each value of ``grid.key`` checked, and none repeated as the point keys it (``normal``:
    ``4`` and ``4.0`` GB, ``"2MiB"`` and ``2097152`` bytes would run one simulation twice)."""
    seen: Dict[str, int] = {}
    for i, item in enumerate(values):
        where = f"grid.{key}[{i}]"
        KINDS[key].check(item, where)
        value = json.dumps(normal(key, item, where))
        if value in seen:
            first = seen[value]
            raise ConfigError(f"{where} {item!r} repeats grid.{key}[{first}] {values[first]!r}: "
                              f"one simulation twice; list each value once")
        seen[value] = i


def normal(key: str, value, where: Optional[str] = None):
    """``value`` as a point holds and keys it: a float key's int as a float, a size with a unit
    in bytes (ConfigError naming ``where`` when it is not one); anything else as it is."""
    kind = KINDS[key]
    if kind.type == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind.size and isinstance(value, str):
        return _size(value, where or key)
    return value


def check_workload_keys(spec: dict) -> None:
    """ConfigError when the spec gives a workload key no point uses: ``rate_scale`` or
    ``max_requests`` without a trace, ``requests``, ``arrival_rate``, ``seed`` or
    ``workload_rng`` when every point replays one (``vmemkv simulate`` refuses --rate-scale
    without --trace the same way). A grid of traces and generated workloads keeps each key
    for the points it applies to."""
    traces = spec["grid"].get("trace") or [spec["base"].get("trace")]
    if all(t is None for t in traces):
        unused, why = TRACE_ONLY, ("apply to a trace, and no point replays one", "arrival_rate "
                                   "and requests")
    elif all(t is not None for t in traces):
        unused, why = GENERATED_ONLY, (f"apply to a generated workload, and every point replays a "
                                       f"trace ({', '.join(map(str, traces))})",
                                       "rate_scale and max_requests")
    else:
        return
    given = [f"{table}.{key}" for table in ("base", "grid") for key in unused if key in spec[table]]
    if given:
        raise ConfigError(f"{', '.join(given)} {why[0]}: the points would be one simulation under "
                          f"several labels; leave them out (the workload's knobs are {why[1]})")


def count_points(spec: dict) -> int:
    """Combinations of the grid's lists (before duplicates are dropped): known before any is
    built, so a huge grid is refused at once."""
    return math.prod(len(values) for values in spec["grid"].values())


def check_size(spec: dict, max_points: int) -> None:
    count = count_points(spec)
    if count > max_points:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in spec["grid"].items())
        raise ConfigError(f"the grid has {count:,} points ({sizes}), more than --max-points "
                          f"{max_points:,}; split it or raise --max-points")


def check_point(point: dict, label: dict, built: set, latest_arrival_s: dict) -> None:
    """What ``vmemkv simulate`` checks before it runs: the SimConfig, the generated workload
    or the trace (``check_trace``, read once per file and max_requests into
    ``latest_arrival_s``), the deployment, the memory manager (built, as ``simulate`` builds it
    before its first step, once per SimConfig in ``built``: its host memory checked first), the
    unit; ConfigError naming the point by its ``label`` (its grid values). Records the point's
    ``POLICY_ID`` in it first (``policy_id``): the file it is keyed by and checked against when
    it runs."""
    try:
        point.update(policy_id(point["policy"]))
        config = sim_config(point)
        if point["trace"] is None:
            workload_spec(point)
        else:
            check_trace(point, latest_arrival_s)
        check_deployment(model=point["model"], gpu=point["gpu"], cache_gb=point["cache_gb"],
                         preemption=point["preemption"], swap_gb=point["swap_gb"],
                         policy=point["policy"], block_size=point["block_size"],
                         max_len=point["max_len"])
        if config not in built:
            check_host_need(f"a pool of {config.pool_units:,} pages or blocks (the manager's "
                            f"tables, before any request is drawn)",
                            simulation_bytes(0, 0, config.pool_units,
                                             unit_bytes=pool_unit_bytes(config)),
                            "give larger pages or blocks, or a smaller cache_gb")
            _build(config)
            built.add(config)
        unit_tokens(point)
    except ConfigError as error:
        raise ConfigError(f"point {point_label(label)}: {error}") from None


def point_label(label: dict) -> str:
    """A point named by its grid values (``cache_gb = 4, policy = 'vmem'``; ``[base]``)."""
    return ", ".join(f"{k} = {v!r}" for k, v in label.items()) or "[base]"


def check_trace(point: dict, latest_arrival_s: dict) -> None:
    """The point's trace read as ``vmemkv simulate`` reads it before it runs (a bad line, lines
    out of the order max_requests needs), once per (trace, max_requests) into
    ``latest_arrival_s``, and its rate_scale, which must keep the latest arrival within
    ``MAX_ARRIVAL_S``: each was refused only when the point ran, the other points run."""
    key = (point["trace"], point["max_requests"])
    if key not in latest_arrival_s:
        entries = load_trace(point["trace"], max_requests=point["max_requests"])
        latest_arrival_s[key] = entries[-1].arrival_s         # sorted by arrival
    if latest_arrival_s[key] / point["rate_scale"] > MAX_ARRIVAL_S:   # the error, as it runs:
        load_trace(point["trace"], rate_scale=point["rate_scale"],
                   max_requests=point["max_requests"])


def _build(config: SimConfig) -> None:
    """Build the point's manager for its ConfigError (what ``simulate`` refuses, exit 2). A
    custom manager that raises anything else fails when its point runs: a row with the error,
    the other points kept (scheduler/sweep.py)."""
    try:
        config.make_manager()
    except ConfigError:
        raise
    except (Exception, SystemExit):   # noqa: BLE001 -- the user's class: its point's row says it
        if not is_custom(config.policy):
            raise


def workload_spec(point: dict) -> WorkloadSpec:
    """The generated workload a point without a trace names."""
    return WorkloadSpec(num_requests=point["requests"], max_total_len=point["max_len"],
                        arrival_rate=point["arrival_rate"], seed=point["seed"],
                        rng=point["workload_rng"])


def point_params(point: dict) -> dict:
    """A point's row before its figures: every parameter, then its trace file's ``TRACE_ID``
    and its policy file's ``POLICY_ID`` (None without one)."""
    return {k: point.get(k) for k in (*PARAMS, *TRACE_ID, *POLICY_ID)}


def point_key(point: dict) -> str:
    """A point's (or its row's) parameters, trace file and policy file as one string, each
    value ``normal`` (``cache_gb`` 4 keys as 4.0): equal keys, equal simulations."""
    return json.dumps({k: normal(k, v) if k in KINDS else v
                       for k, v in point_params(point).items()}, sort_keys=True)


def trace_ids(spec: dict) -> Dict[str, dict]:
    """Each trace the spec names -> its ``TRACE_ID``: the resolved absolute path (a bundled
    trace: ``bundled:NAME``, as ``load_trace`` prefers the name) and the sha256 of its bytes;
    ConfigError naming the key of one that cannot be read."""
    named = [("base.trace", spec["base"].get("trace"))] + \
        [(f"grid.trace[{i}]", t) for i, t in enumerate(spec["grid"].get("trace", []))]
    ids: Dict[str, dict] = {}
    for where, trace in named:
        if trace is None or trace in ids:
            continue
        if trace in BUNDLED:
            path, file = f"bundled:{trace}", resources.files(__package__).joinpath(
                "data", "traces", BUNDLED[trace].file)
        else:
            path = file = os.path.realpath(trace)
            if os.path.exists(trace) and not (os.path.isfile(trace) or os.path.isdir(trace)):
                raise ConfigError(f"{where}: trace {trace!r} ({path}) is not a regular file (a "
                                  f"pipe or a device, read once): a sweep reads its trace for "
                                  f"each point and keys their rows by its sha256; write it to "
                                  f"a file")    # the points read what the hash left: none
        try:
            with open(file, "rb") if isinstance(file, str) else file.open("rb") as f:
                digest = sha256_of(f)
        except OSError as error:
            raise ConfigError(f"{where}: cannot read trace {trace!r} ({path}): "
                              f"{error.strerror or error}") from None
        ids[trace] = {"trace_path": path, "trace_sha256": digest}
    return ids


def _size(text: str, where: str) -> int:
    import argparse
    try:
        return parse_bytes(text)
    except argparse.ArgumentTypeError as error:
        raise ConfigError(f"{where} {error}") from None


def sim_config(point: dict) -> SimConfig:
    """The SimConfig a point names (ConfigError naming the field when a value is bad, or when
    its policy file changed since the point was keyed: ``check_policy_unchanged``)."""
    check_policy_unchanged(point)
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


def unit_tokens(point: dict) -> Optional[int]:
    """Tokens per allocation unit: the paged block, the vmem page (group); None for the other
    policies (a reservation is per sequence, not a fixed unit)."""
    if point["policy"] == "paged":
        return point["block_size"]
    if point["policy"] == "vmem":      # layout "auto" as the simulation resolves it
        config = sim_config(point)
        return PageGeometry.of(config.model_spec, config.page_bytes,
                               config.resolved_layout).tokens_per_page
    return None
