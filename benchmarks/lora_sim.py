"""Many LoRA adapters in the simulator (issue 31): one pool that adapters and KV share
(S-LoRA's unified paging) against a static split of the same bytes, the same scheduler.

    python -m vmemkv.benchmarks.lora_sim [--requests 2000] [--rate 40] [--adapters 10 100 1000]
                                         [--static-rank64 8 32] [--out FILE.json]

Llama-3-8B on one H100 (``SimConfig``'s defaults: roofline cost, paged 16-token blocks, no
admission watermark, recompute preemption), 20 GB for KV and adapters together. The workload: the
standard workload's lengths (seed 0) with Poisson arrivals at RATE requests/s, every request
naming one of N adapters drawn Zipf(1) (S-LoRA's power law), each adapter's rank drawn from
{8, 16, 32, 64} (LoRA on q, k, v, o, fp16: 13.6 to 109 MB for Llama-3-8B). Adapter loads are
charged at 25 GB/s host to device, not overlapped with compute; each step reads its batch's
distinct adapters once at the memory bandwidth.

The static arms give adapters a fixed region sized for K rank-64 adapters (``--static-rank64``,
default 8 and 32: 0.87 GB and 3.49 GB), KV the rest of the 20 GB: adapter memory reserved up
front as a server that preallocates adapter slots does, whatever the adapters in use need.
"""
from __future__ import annotations

import time
from dataclasses import replace

from vmemkv.benchmarks.common import exit_status, format_table, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import (LoraSpec, WorkloadSpec, generate, lora_adapter_bytes,
                                       lora_workload)
from vmemkv.scheduler.cliargs import (NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT,
                                      DistinctValues, bounded, result_file)

TOTAL_BYTES = 20 * 10**9
MODEL = "llama-3-8b"
COLUMNS = ["adapters", "arm", "adapter_GB", "output_tok_s", "steady_tok_s", "steady_batch",
           "resident_mean", "resident_peak", "held_GB_mean", "step_adapters", "loads",
           "evictions", "load_s", "preemptions", "ttft_p90_s"]


def arms(static_rank64) -> list:
    """(name, adapter_budget_bytes): the unified pool, then each static split."""
    r64 = lora_adapter_bytes(get_model(MODEL), 64)
    return [("unified", None)] + [(f"static {k} x r64", k * r64) for k in static_rank64]


def run(requests: int = 2000, rate: float = 40.0, adapters=(10, 100, 1000),
        static_rank64=(8, 32), zipf: float = 1.0, policy: str = "paged", seed: int = 0,
        out=None) -> dict:
    model = get_model(MODEL)
    spec = WorkloadSpec(num_requests=requests, arrival_rate=rate, seed=seed)
    print(f"# {MODEL} on h100, {TOTAL_BYTES / 1e9:g} GB for KV and adapters, {policy}; "
          f"{requests} requests at {rate:g}/s, Zipf({zipf:g}) over N adapters of rank 8-64",
          flush=True)
    base = SimConfig(policy=policy, model=MODEL, cache_bytes=TOTAL_BYTES)
    unit = base.page_bytes if policy == "vmem" else base.block_size * model.bytes_per_token
    rows = [_row(simulate(generate(spec), base), "-", "no adapters", None, unit)]
    for n in adapters:
        entries = lora_workload(spec, LoraSpec(n, zipf, seed=seed), model)
        for arm, budget in arms(static_rank64):
            start = time.perf_counter()
            r = simulate(entries, replace(base, adapter_budget_bytes=budget))
            rows.append(_row(r, n, arm, budget, unit, time.perf_counter() - start))
            print(f"# N={n} {arm}: {rows[-1]['wall_s']:.1f} s", flush=True)
    print(format_table(rows, COLUMNS))
    payload = dict(model=MODEL, device="h100", total_bytes=TOTAL_BYTES, policy=policy,
                   requests=requests, rate=rate, zipf=zipf, seed=seed,
                   static_rank64=list(static_rank64), rows=rows)
    write_json(out, payload)
    return payload


def _row(r, n, arm: str, budget, unit: int, wall_s: float = 0.0) -> dict:
    """One run's figures; ``adapter_GB``: what adapters may hold (unified: the whole pool)."""
    return dict(adapters=n, arm=arm,
                adapter_GB=(TOTAL_BYTES if budget is None else budget) / 1e9 if n != "-" else 0,
                output_tok_s=r.output_tokens_per_s,
                steady_tok_s=r.steady.get("steady_output_tokens_per_s", 0.0),
                steady_batch=r.steady.get("steady_mean_batch", 0.0),
                resident_mean=r.mean_adapters_resident, resident_peak=r.peak_adapters_resident,
                held_GB_mean=r.mean_adapter_pages * unit / 1e9,
                step_adapters=r.mean_step_adapters, loads=r.adapter_loads,
                evictions=r.adapter_evictions, load_s=r.adapter_load_seconds,
                read_s=r.adapter_read_seconds, preemptions=r.num_preemptions,
                ttft_p90_s=r.serving["p90_ttft_ms"] / 1e3, simulated_s=r.simulated_seconds,
                mean_adapter_pages=r.mean_adapter_pages, peak_adapter_pages=r.peak_adapter_pages,
                output_tokens=r.output_tokens, wall_s=wall_s)


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=POSITIVE_INT, default=2000, help="requests per run")
    parser.add_argument("--rate", type=POSITIVE_FLOAT, default=40.0,
                        help="Poisson arrivals, requests/s (default 40: above what 20 GB serves)")
    parser.add_argument("--adapters", type=POSITIVE_INT, nargs="+", default=[10, 100, 1000],
                        action=DistinctValues)
    parser.add_argument("--static-rank64", type=NON_NEGATIVE_INT, nargs="+", default=[8, 32],
                        action=DistinctValues,
                        help="static arms: adapter memory for this many rank-64 adapters")
    parser.add_argument("--zipf", type=bounded(float, 0), default=1.0, help="popularity exponent")
    parser.add_argument("--policy", choices=("paged", "vmem"), default="paged")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    parser.add_argument("--out", default=None, type=result_file, help="JSON file (written whole or not at all)")
    args = parser.parse_args(argv)
    run(args.requests, args.rate, tuple(args.adapters), tuple(args.static_rank64), args.zipf,
        args.policy, args.seed, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("lora_sim", main))
