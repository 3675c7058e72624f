"""``vmemkv simulate``'s output: the human table, and mean +- std over several seeds.

A run's figures are one flat dict (``SimResult.to_dict()`` plus ``config``). ``--seeds 0-4``
runs the workload once per seed and reports, for every numeric figure, the mean and the
population standard deviation over the seeds (``aggregate``); the table then shows
"mean ± std".
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Dict, List, Sequence

# label, whole-run key, steady-state key (or None), format of one value
_ROWS = [
    ("output tokens/s", "output_tokens_per_s", "steady_output_tokens_per_s", "{:,.1f}"),
    ("mean batch (seqs/step)", "mean_batch", "steady_mean_batch", "{:,.1f}"),
    ("kv utilisation (live/alloc)", "kv_utilization", "steady_kv_utilization", "{:.1%}"),
    ("held utilisation", "held_utilization", "steady_held_utilization", "{:.1%}"),
    ("kv cache usage", "kv_cache_usage_perc", "steady_kv_cache_usage_perc", "{:.1%}"),
    ("mean end waste (tok/seq)", "mean_end_waste_tokens", "steady_mean_end_waste_tokens",
     "{:,.1f}"),
    ("steps", "num_steps", "steady_steps", "{:,.0f}"),
    ("simulated seconds", "simulated_seconds", "steady_seconds", "{:,.2f}"),
    ("preemptions", "num_preemptions", None, "{:,.0f}"),
    ("  of which swapped", "num_swap_preemptions", None, "{:,.0f}"),
    ("recomputed tokens", "recomputed_tokens", None, "{:,.0f}"),
    ("prefix cache hits", "prefix_cache_hits", None, "{:,.0f}"),
    ("memory saved by sharing", "sharing_saved", None, "{:.1%}"),
    ("output tokens", "output_tokens", None, "{:,.0f}"),
    ("request throughput (req/s)", "request_throughput", None, "{:,.2f}"),
    ("total token throughput", "total_token_throughput", None, "{:,.1f}"),
    ("TTFT median / p99 (ms)", "median_ttft_ms", "p99_ttft_ms", "{:,.0f}"),
    ("TPOT median / p99 (ms)", "median_tpot_ms", "p99_tpot_ms", "{:,.2f}"),
    ("ITL median / p99 (ms)", "median_itl_ms", "p99_itl_ms", "{:,.2f}"),
    ("E2EL median / p99 (ms)", "median_e2el_ms", "p99_e2el_ms", "{:,.0f}"),
    ("request goodput (req/s)", "request_goodput", None, "{:,.2f}"),
    ("wall seconds", "wall_seconds", None, "{:.3f}"),
]
_LORA_ROWS = [   # a run with LoRA adapters (--lora-adapters) only
    ("adapters resident mean / peak", "mean_adapters_resident", "peak_adapters_resident",
     "{:,.1f}"),
    ("adapter loads", "adapter_loads", None, "{:,.0f}"),
    ("adapter evictions", "adapter_evictions", None, "{:,.0f}"),
    ("adapter load / read seconds", "adapter_load_seconds", "adapter_read_seconds", "{:,.2f}"),
]


def parse_seeds(text: str) -> List[int]:
    """``0-4`` -> [0, 1, 2, 3, 4]; ``1,5,9`` -> [1, 5, 9] (argparse type; each seed >= 0)."""
    seeds: List[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            seeds.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want seeds as FIRST-LAST or a comma list of ints >= 0 (0-4, 1,5,9), got {text!r}") from None
    return seeds


def aggregate(runs: Sequence[dict]) -> Dict[str, Dict[str, float]]:
    """``{"mean": {...}, "std": {...}}`` of every numeric figure present in every run (std:
    population standard deviation over the runs; 0 for one run)."""
    keys = [k for k, v in runs[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and all(isinstance(r.get(k), (int, float)) for r in runs)]
    mean = {k: statistics.fmean(r[k] for r in runs) for k in keys}
    std = {k: statistics.pstdev([r[k] for r in runs]) if len(runs) > 1 else 0.0 for k in keys}
    return {"mean": mean, "std": std}


def _value(fmt: str, d: dict, key: str, std: dict) -> str:
    if d.get(key) is None or (isinstance(d[key], float) and math.isnan(d[key])):
        return "-"
    text = fmt.format(d[key])
    return f"{text} ± {fmt.format(std[key]).lstrip('-')}" if key in std else text


def format_table(d: dict, std: Dict[str, float] = None, seeds: Sequence[int] = ()) -> str:
    """The run ``d`` (or the mean of several, with their ``std``) as an aligned table."""
    std, c = std or {}, d["config"]
    over = f", mean ± std over seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else ""
    where = (f"profile {c['profile']}" if c.get("profile")
             else f"{c['model_preset']} on {c['gpu']}")
    lines = [f"vmemkv simulate: {d['policy']}, {where}, "
             f"{c['cache_gb']:g} GB cache, {d['num_requests']:,.0f} requests{over}",
             f"  {'':<28} {'whole run':>20} {'steady state':>20}"]
    for label, key, second, fmt in _ROWS + (_LORA_ROWS if d.get("adapter_loads") else []):
        if key not in d:
            continue
        right = _value(fmt, d, second, std) if second else ""
        if second and " / " in label:        # median / p99 pairs share the first column
            lines.append(f"  {label:<28} {_value(fmt, d, key, std) + ' / ' + right:>41}")
            continue
        lines.append(f"  {label:<28} {_value(fmt, d, key, std):>20} {right:>20}")
    return "\n".join(lines) + "\n"
