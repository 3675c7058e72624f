"""``vmemkv simulate``: run a workload through a memory policy on the cost model.

Defaults are the project's standard workload (docs/simulation.md): 2,000 requests at time 0,
prompts log-normal (median 584, p95 2,155), outputs log-normal (mean 374, p95 1,118), at most
4,096 tokens, Llama-3-8B on one H100, 60 GB of cache.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from .errors import ConfigError
from .presets import DEVICES, MODELS
from .progress import Progress
from .scheduler import PREEMPTION_MODES, SchedulerConfig
from .simulator import LAYOUTS, POLICIES, SimConfig, simulate
from .workload import WorkloadSpec, generate, read_trace, write_trace

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'2097152', '2MiB', '64 KiB', '1GB' -> bytes (argparse type; one-line error)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: want bytes, or a number with KiB, MiB, GiB, KB, MB or GB")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a workload under a KV memory policy",
                              description="Run a workload through a KV memory policy on the "
                                          "roofline cost model; defaults: the standard workload.")
    w = p.add_argument_group("workload (ignored with --trace)")
    w.add_argument("--requests", type=int, default=2000, help="number of requests")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-median", type=float, default=584.0, help="tokens")
    w.add_argument("--prompt-p95", type=float, default=2155.0, help="tokens")
    w.add_argument("--output-mean", type=float, default=374.0, help="tokens")
    w.add_argument("--output-p95", type=float, default=1118.0, help="tokens")
    w.add_argument("--max-len", type=int, default=4096,
                   help="max tokens per sequence (prompt + output clipped to it)")
    w.add_argument("--arrival-rate", type=float, default=0.0,
                   help="Poisson arrivals, requests/s (0: all at time 0)")
    w.add_argument("--trace", metavar="FILE", help="JSONL trace (prompt_len, output_len, arrival_s)")
    w.add_argument("--write-trace", metavar="FILE", help="also write the workload as a JSONL trace")
    m = p.add_argument_group("deployment")
    m.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    m.add_argument("--device", choices=sorted(DEVICES), default="h100")
    m.add_argument("--cache-gb", type=float, default=60.0, help="KV cache size, GB (10^9 bytes)")
    m.add_argument("--policy", choices=POLICIES, default="paged")
    m.add_argument("--block-size", type=int, default=16, help="tokens per block (paged)")
    m.add_argument("--page-size", type=parse_bytes, default=2 * 2**20,
                   help="bytes per physical page (vmem), e.g. 2MiB, 64KiB (default 2MiB)")
    m.add_argument("--layout", choices=LAYOUTS, default="per-layer")
    s = p.add_argument_group("scheduler")
    s.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of the cache admission keeps free (default 0.01)")
    s.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute")
    s.add_argument("--swap-gb", type=float, default=0.0, help="host swap space, GB")
    s.add_argument("--max-running", type=int, default=1024, help="sequences per step")
    s.add_argument("--max-tokens-per-step", type=int, default=8192, help="new tokens per step")
    c = p.add_argument_group("cost model")
    c.add_argument("--prefill-mfu", type=float, default=None,
                   help="cost prefill as compute-bound at this MFU (default: bandwidth only)")
    c.add_argument("--map-latency-us", type=float, default=0.0,
                   help="microseconds per physical page mapped (vmem)")
    c.add_argument("--paged-slowdown", type=float, default=1.0,
                   help="KV read-time multiplier for paged kernels")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _entries(args):
    if args.trace:
        return read_trace(args.trace)
    spec = WorkloadSpec(num_requests=args.requests, prompt_median=args.prompt_median,
                        prompt_p95=args.prompt_p95, output_mean=args.output_mean,
                        output_p95=args.output_p95, max_total_len=args.max_len,
                        arrival_rate=args.arrival_rate, seed=args.seed)
    return generate(spec)


def _config(args) -> SimConfig:
    sched = SchedulerConfig(max_running=args.max_running,
                            max_tokens_per_step=args.max_tokens_per_step,
                            watermark=args.watermark, preemption=args.preemption)
    return SimConfig(policy=args.policy, model=args.model, device=args.device,
                     cache_bytes=int(args.cache_gb * 1e9), max_seq_len=args.max_len,
                     block_size=args.block_size, page_bytes=args.page_size, layout=args.layout,
                     swap_bytes=int(args.swap_gb * 1e9), scheduler=sched,
                     prefill_mfu=args.prefill_mfu, map_latency_s=args.map_latency_us * 1e-6,
                     paged_slowdown=args.paged_slowdown)


def run(args) -> int:
    if args.cache_gb <= 0 or args.swap_gb < 0:
        raise ConfigError(f"--cache-gb must be > 0 and --swap-gb >= 0, "
                          f"got {args.cache_gb} and {args.swap_gb}")
    config = _config(args)
    entries = _entries(args)
    if args.write_trace:
        write_trace(args.write_trace, entries)
    enabled = None if not args.no_progress and len(entries) >= 200 else False
    with Progress(len(entries), f"simulate {args.policy}", enabled=enabled) as bar:
        result = simulate(entries, config, on_finished=bar.update)
    out = result.to_dict()
    out["config"] = {k: getattr(args, k) for k in (
        "model", "device", "cache_gb", "policy", "block_size", "page_size", "layout",
        "watermark", "preemption", "swap_gb", "max_running", "max_tokens_per_step", "seed",
        "trace")}
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write(format_table(out))
    return 0


_ROWS = [
    ("output tokens/s", "output_tokens_per_s", "{:,.1f}"),
    ("mean batch (seqs/step)", "mean_batch", "{:,.1f}"),
    ("kv utilisation (live/alloc)", "kv_utilization", "{:.1%}"),
    ("held utilisation", "held_utilization", "{:.1%}"),
    ("kv cache usage", "kv_cache_usage_perc", "{:.1%}"),
    ("mean end waste (tok/seq)", "mean_end_waste_tokens", "{:,.1f}"),
    ("preemptions", "num_preemptions", "{:,}"),
    ("  of which swapped", "num_swap_preemptions", "{:,}"),
    ("recomputed tokens", "recomputed_tokens", "{:,}"),
    ("prefix cache hits/queries", None, None),
    ("output tokens", "output_tokens", "{:,}"),
    ("steps", "num_steps", "{:,}"),
    ("simulated seconds", "simulated_seconds", "{:,.2f}"),
    ("TTFT p50 / p99 (s)", None, None),
    ("ITL p50 / p99 (ms)", None, None),
    ("wall seconds", "wall_seconds", "{:.3f}"),
]


def format_table(d: dict) -> str:
    c = d["config"]
    lines = [f"vmemkv simulate: {d['policy']}, {c['model']} on {c['device']}, "
             f"{c['cache_gb']:g} GB cache, {d['num_requests']:,} requests"]
    for label, key, fmt in _ROWS:
        if key is not None:
            value = fmt.format(d[key])
        elif label.startswith("prefix"):
            value = f"{d['prefix_cache_hits']:,} / {d['prefix_cache_queries']:,}"
        elif label.startswith("TTFT"):
            value = f"{d['ttft_p50_s']:.2f} / {d['ttft_p99_s']:.2f}"
        else:
            value = f"{d['itl_p50_s'] * 1e3:.2f} / {d['itl_p99_s'] * 1e3:.2f}"
        lines.append(f"  {label:<28} {value:>16}")
    return "\n".join(lines) + "\n"
