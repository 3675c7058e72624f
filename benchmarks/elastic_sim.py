"""Two Llama-3-8B on one H100 in the simulator: one shared MemoryBudget against a static 50/50
split of the KV memory, on bursts out of phase (issue 32), both arms in one run.

    python -m vmemkv.benchmarks.elastic_sim [--quick] [--rates 60 90] [--out FILE.json]

The KV memory is the H100's 80 GB less both models' weights (``kv_bytes_after_weights``: no
headroom for activations, an upper bound), vmem interleaved on 2 MiB pages. The workload
(``BurstySpec``, scheduler/shared_workloads.py): each model 15 s bursts of Poisson arrivals
at RATE requests/s once a minute, the two models 30 s apart, nothing between bursts, lengths
from the standard workload; seeded.
The elastic arm: each share's minimum 10% of the memory, up to all of it, idle for 2 s before
giving back; page creation and release charged at the published A100 figures
(scheduler/shared_sim.py). Compute is not contended between the models, only memory (the
simulator's stated limit): the difference between the arms is the memory policy's.
"""
from __future__ import annotations

import time

from vmemkv.benchmarks.common import exit_status, format_table, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.shared_sim import SharedConfig, kv_bytes_after_weights, simulate_shared
from vmemkv.scheduler.shared_workloads import BurstySpec, bursty_workload
from vmemkv.scheduler.cliargs import NON_NEGATIVE_INT, POSITIVE_FLOAT, DistinctValues, result_file

FULL = dict(duration_s=240.0, rates=(60.0, 90.0))
QUICK = dict(duration_s=60.0, rates=(60.0,))


def run(quick: bool = False, rates=None, seed: int = 0, out=None) -> dict:
    shape = QUICK if quick else FULL
    rates = tuple(rates or shape["rates"])
    total = kv_bytes_after_weights("h100", ("llama-3-8b", "llama-3-8b"))
    print(f"# two llama-3-8b on one h100: {total / 1e9:.1f} GB of KV in all; bursts of 15 s "
          f"once a minute, 30 s apart, {shape['duration_s']:.0f} s of arrivals", flush=True)
    rows = []
    for rate in rates:
        spec = BurstySpec(duration_s=shape["duration_s"], period_s=60.0, burst_fraction=0.25,
                          burst_rate=rate, quiet_rate=0.0, seed=seed)
        workloads = bursty_workload(spec)
        got = {}
        for arm, elastic in (("static 50/50", False), ("shared budget", True)):
            start = time.perf_counter()
            res = simulate_shared(workloads, SharedConfig(elastic=elastic, min_fraction=0.1,
                                                          idle_release_s=2.0))
            o = res.overall
            got[arm] = o
            rows.append(dict(rate=rate, arm=arm, requests=o["num_requests"],
                             ttft_p50_s=o["ttft_p50_s"], ttft_p90_s=o["ttft_p90_s"],
                             output_tok_s=o["output_tokens_per_s"],
                             preemptions=o["num_preemptions"], grows=o["grows"],
                             gives=o["gives"], peak_GB=res.peak_held_bytes / 1e9,
                             peak_GB_per_model=max(m.peak_cache_bytes
                                                   for m in res.models.values()) / 1e9))
            print(f"# rate {rate:g}/s {arm}: {time.perf_counter() - start:.1f} s", flush=True)
        s, e = got["static 50/50"], got["shared budget"]
        rows[-1]["ttft_p90_ratio"] = s["ttft_p90_s"] / e["ttft_p90_s"]
        rows[-1]["throughput_ratio"] = e["output_tokens_per_s"] / s["output_tokens_per_s"]
    columns = ["rate", "arm", "requests", "ttft_p50_s", "ttft_p90_s", "output_tok_s",
               "preemptions", "grows", "gives", "peak_GB_per_model"]
    print(format_table(rows, columns))
    for row in rows:
        if "ttft_p90_ratio" in row:
            print(f"# rate {row['rate']:g}/s: TTFT p90 static/shared {row['ttft_p90_ratio']:.2f}x,"
                  f" throughput shared/static {row['throughput_ratio']:.2f}x")
    payload = dict(total_kv_bytes=total, shape=shape, rows=rows)
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 s of arrivals at one rate")
    parser.add_argument("--rates", type=POSITIVE_FLOAT, nargs="+", default=None,
                        action=DistinctValues,
                        help="burst arrival rates, requests/s (default: 60 90)")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    parser.add_argument("--out", default=None, type=result_file, help="JSON file (written whole or not at all)")
    args = parser.parse_args(argv)
    run(args.quick, args.rates, args.seed, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("elastic_sim", main))
