"""``vmemkv simulate``'s output: the human table, and mean +- std over several seeds.

A run's figures are one flat dict (``SimResult.to_dict()`` plus ``config``). ``--seeds 0-4``
runs the workload once per seed and reports, for every numeric figure, the mean and the
population standard deviation over the seeds (``aggregate``; a figure a run does not have,
None, such as steady-state means without a steady step, is left out of them); the table then
shows "mean ± std". ``to_json`` writes a figure that is not a finite number as null (strict
JSON has no NaN).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence


def _ms(value: float) -> str:
    """Milliseconds for the table: whole from 10 ms, three significant digits below (whole
    ms showed a small model's 0.09 ms TTFT as 0)."""
    return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.3g}"


# label, whole-run key, steady-state key (or None), format of one value (value -> text)
_ROWS = [
    ("output tokens/s", "output_tokens_per_s", "steady_output_tokens_per_s", "{:,.1f}".format),
    ("mean batch (seqs/step)", "mean_batch", "steady_mean_batch", "{:,.1f}".format),
    ("kv utilisation (live/alloc)", "kv_utilization", "steady_kv_utilization", "{:.1%}".format),
    ("held utilisation", "held_utilization", "steady_held_utilization", "{:.1%}".format),
    ("kv cache usage", "kv_cache_usage_perc", "steady_kv_cache_usage_perc", "{:.1%}".format),
    ("mean end waste (tok/seq)", "mean_end_waste_tokens", "steady_mean_end_waste_tokens",
     "{:,.1f}".format),
    ("steps", "num_steps", "steady_steps", "{:,.0f}".format),
    ("simulated seconds", "simulated_seconds", "steady_seconds", "{:,.2f}".format),
    ("preemptions", "num_preemptions", None, "{:,.0f}".format),
    ("  of which swapped", "num_swap_preemptions", None, "{:,.0f}".format),
    ("  swap copy seconds", "swap_seconds", None, "{:,.3f}".format),
    ("recomputed tokens", "recomputed_tokens", None, "{:,.0f}".format),
    ("prefix cache hits", "prefix_cache_hits", None, "{:,.0f}".format),
    ("memory saved by sharing", "sharing_saved", None, "{:.1%}".format),
    ("requests failed (beams outgrew the cache)", "failed_requests", None,
     "{:,.0f}".format),
    ("output tokens", "output_tokens", None, "{:,.0f}".format),
    ("request throughput (req/s)", "request_throughput", None, "{:,.2f}".format),
    ("total token throughput (tok/s)", "total_token_throughput", None, "{:,.1f}".format),
    ("TTFT median / p99 (ms)", "median_ttft_ms", "p99_ttft_ms", _ms),
    ("TPOT median / p99 (ms)", "median_tpot_ms", "p99_tpot_ms", "{:,.2f}".format),
    ("ITL median / p99 (ms)", "median_itl_ms", "p99_itl_ms", "{:,.2f}".format),
    ("E2EL median / p99 (ms)", "median_e2el_ms", "p99_e2el_ms", _ms),
    ("request goodput (req/s)", "request_goodput", None, "{:,.2f}".format),
    ("wall seconds", "wall_seconds", None, "{:.3f}".format),
]
# the labels' column: "total token throughput (tok/s)" wide (longer ones push their row right)
LABEL_WIDTH = 30
_LORA_ROWS = [   # a run with LoRA adapters (--lora-adapters) only
    ("adapters resident mean / peak", "mean_adapters_resident", "peak_adapters_resident",
     "{:,.1f}".format),
    ("adapter loads", "adapter_loads", None, "{:,.0f}".format),
    ("adapter evictions", "adapter_evictions", None, "{:,.0f}".format),
    ("adapter load / read seconds", "adapter_load_seconds", "adapter_read_seconds",
     "{:,.2f}".format),
]


# seeds one ``--seeds`` may give: each is a whole simulation run (about 2 s for the standard
# workload, 2026-12-06), so 10,000 is hours of runs, while the seed list and its Counter stay
# about 1 MB
MAX_SEEDS = 10_000


def parse_seeds(text: str) -> List[int]:
    """``0-4`` -> [0, 1, 2, 3, 4]; ``1,5,9`` -> [1, 5, 9] (argparse type; each seed >= 0,
    none twice: a repeated seed is the same run again, and would shrink the std; at most
    ``MAX_SEEDS`` in all, counted before any range is expanded)."""
    bounds: List[tuple] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            bounds.append((first, last))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want seeds as FIRST-LAST or a comma list of ints >= 0 (0-4, 1,5,9), got {text!r}") from None
    count = sum(last - first + 1 for first, last in bounds)
    if count > MAX_SEEDS:     # 0-400000000 built 400 M ints and a Counter: a MemoryError traceback
        raise argparse.ArgumentTypeError(
            f"{text!r} is {count:,} seeds, more than {MAX_SEEDS:,} (each seed is a whole "
            f"simulation run); give fewer seeds")
    seeds = [seed for first, last in bounds for seed in range(first, last + 1)]
    repeated = sorted(s for s, n in Counter(seeds).items() if n > 1)
    if repeated:
        raise argparse.ArgumentTypeError(
            f"seed {', '.join(map(str, repeated))} given twice in {text!r}: each seed once")
    return seeds


def seeds_text(seeds: Sequence[int]) -> str:
    """``[0, 1, 2]`` -> ``0-2``; ``[1, 5, 9]`` -> ``1, 5, 9`` (as the seeds ran)."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate(runs: Sequence[dict]) -> Dict[str, Dict[str, float]]:
    """``{"mean": {...}, "std": {...}}`` of every numeric figure (std: population standard
    deviation over the runs; 0 for one run). A figure that is None or NaN in some runs (a
    steady-state mean where a run had no steady step; the TPOT of a run whose requests all
    have one output token) is over the runs that have it, and ``"counts"`` says over how many
    (a NaN took the mean with it, and crashed the std); one that is NaN in every run is NaN,
    one that no run has at all is left out."""
    keys = [k for k in runs[0]
            if all(_number(r.get(k)) or r.get(k) is None for r in runs)
            and any(_number(r.get(k)) for r in runs)]
    values = {k: [r[k] for r in runs if _number(r.get(k)) and not math.isnan(r[k])]
              for k in keys}
    mean = {k: statistics.fmean(v) if v else math.nan for k, v in values.items()}
    std = {k: statistics.pstdev(v) if len(v) > 1 else 0.0 if v else math.nan
           for k, v in values.items()}
    counts = {k: len(v) for k, v in values.items() if len(v) < len(runs)}
    return {"mean": mean, "std": std, **({"counts": counts} if counts else {})}


def to_json(obj) -> str:
    """``obj`` as strict JSON: a float that is not finite (a TPOT of requests with one output
    token is NaN) is written null."""
    return json.dumps(_finite(obj), allow_nan=False)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _value(fmt: Callable[[float], str], d: dict, key: str, std: dict) -> str:
    if d.get(key) is None or (isinstance(d[key], float) and math.isnan(d[key])):
        return "-"
    text = fmt(d[key])
    return f"{text} ± {fmt(std[key]).lstrip('-')}" if key in std else text


def format_table(d: dict, std: Optional[Dict[str, float]] = None, seeds: Sequence[int] = (),
                 counts: Optional[Dict[str, int]] = None) -> str:
    """The run ``d`` (or the mean of several, with their ``std`` and, for figures only some
    runs have, their ``counts``) as an aligned table; "-" for a figure the run does not have."""
    std, c = std or {}, d["config"]
    over = f", mean ± std over seeds {seeds_text(seeds)}" if len(seeds) > 1 else ""
    where = (f"profile {c['profile']}" if c.get("profile")
             else f"{c['model_preset']} on {c['gpu']}")
    lines = [f"vmemkv simulate: {d['policy']}, {where}, "
             f"{c['cache_gb']:g} GB cache, {d['num_requests']:,.0f} requests{over}",
             f"  {'':<{LABEL_WIDTH}} {'whole run':>20} {'steady state':>20}"]
    for label, key, second, fmt in _ROWS + (_LORA_ROWS if d.get("adapter_loads") else []):
        if key not in d:
            continue
        right = _value(fmt, d, second, std) if second else ""
        if second and " / " in label:        # median / p99 pairs share the first column
            lines.append(f"  {label:<{LABEL_WIDTH}} {_value(fmt, d, key, std) + ' / ' + right:>41}")
            continue
        lines.append(f"  {label:<{LABEL_WIDTH}} {_value(fmt, d, key, std):>20} {right:>20}")
    steady = (counts or {}).get("steady_mean_batch")
    if steady is not None:
        lines.append(f"  steady state over the {steady} of {len(seeds)} seeds whose runs had "
                     f"a queue")
    for label, key, _, _ in _ROWS:       # TPOT, ITL: requests of one output token have none
        if key in (counts or {}) and not key.startswith("steady_") and counts[key]:
            lines.append(f"  {label.split(' (')[0]} over the {counts[key]} of {len(seeds)} "
                         f"seeds whose runs have it")
    return "\n".join(lines) + "\n"
