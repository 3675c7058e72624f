"""Simulator speed: wall time of one 2,000-request standard-workload simulation per policy.

    .venv/bin/python benchmarks/simulate.py [--repeats 3] [--cache-gb 60 20] [--json out.json]

Fixed seed, one warm-up run, median of ``--repeats``. One aligned line per configuration: wall
seconds, CPU seconds, steps, and microseconds of CPU per scheduled sequence-step (the
simulator's unit of work: one decode or prefill chunk of one sequence), then the same as one
JSON object. The target is < 2 s of wall time per policy (issues 3 and 13). ``cpu s`` is the
process's CPU time (``time.process_time``) over the same span as the wall time: on a shared
machine it is the figure that does not grow with other jobs' load, so the per-step figure is
computed from it.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

from vmemkv.benchmarks.common import check_sim_cache_gb, exit_status
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.result_files import write_json
from vmemkv.scheduler.workload import WorkloadSpec, generate
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, POSITIVE_INT, DistinctValues, result_file

CONFIGS = [("reserve-max", "per-layer"), ("reserve-oracle", "per-layer"), ("paged", "per-layer"),
           ("vmem", "per-layer"), ("vmem", "interleaved")]


def bench(entries, policy: str, layout: str, cache_gb: float, repeats: int) -> dict:
    config = SimConfig(policy=policy, layout=layout, cache_bytes=int(cache_gb * 1e9),
                       scheduler=SchedulerConfig(watermark=0.05))
    simulate(entries, config)                              # warm-up
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(entries, config)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    seq_steps = result.mean_batch * result.num_steps
    return {"policy": policy, "layout": layout, "cache_gb": cache_gb, "wall_s": wall,
            "wall_min_s": min(walls), "cpu_s": cpu, "steps": result.num_steps,
            "seq_steps": seq_steps, "cpu_us_per_seq_step": cpu / seq_steps * 1e6,
            "output_tokens_per_s_simulated": result.output_tokens_per_s}


def main(argv=None) -> None:
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=POSITIVE_INT, default=3)
    ap.add_argument("--cache-gb", type=POSITIVE_FLOAT, nargs="+", default=[60.0, 20.0],
                    action=DistinctValues)
    ap.add_argument("--json", metavar="FILE", type=result_file, help="also write the JSON here")
    args = ap.parse_args(argv)
    for gb in args.cache_gb:
        check_sim_cache_gb(ap, gb)
    entries = generate(WorkloadSpec())
    print(f"standard workload, 2,000 requests; python {platform.python_version()} on "
          f"{platform.machine()}, {os.cpu_count()} CPUs; median of {args.repeats}")
    print(f"{'policy':<26}{'cache GB':>9}{'wall s':>9}{'cpu s':>8}{'steps':>8}"
          f"{'cpu us/seq-step':>17}{'< 2 s':>7}")
    rows = []
    for gb in args.cache_gb:
        for policy, layout in CONFIGS:
            r = bench(entries, policy, layout, gb, args.repeats)
            rows.append(r)
            name = policy if policy != "vmem" else f"vmem {layout}"
            print(f"{name:<26}{gb:>9g}{r['wall_s']:>9.3f}{r['cpu_s']:>8.3f}{r['steps']:>8}"
                  f"{r['cpu_us_per_seq_step']:>17.2f}{'yes' if r['wall_s'] < 2 else 'NO':>7}",
                  flush=True)
    out = {"benchmark": "simulate", "python": platform.python_version(), "rows": rows}
    print(json.dumps(out))
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    raise SystemExit(exit_status("simulate", main))
