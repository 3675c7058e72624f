"""KV memory utilisation and end waste against paged block size and vmem page size x layout.

    python -m vmemkv.benchmarks.memory [--quick] [--cache-gb 20] [--out bench_out/memory.json]

Runs the standard log-normal workload (docs/simulation.md: seed 0, prompts median 584 / p95
2,155, outputs mean 374 / p95 1,118, Llama-3-8B on an H100) through the simulator -- the real
scheduler and memory managers, with the cost model as the clock -- once per allocation unit:

    paged      blocks of 16 ... 1,024 tokens
    vmem       per-layer pages of 64 KiB ... 2 MiB   (a page holds one layer's K or V: 32 ... 1,024 tokens)
               interleaved pages of 2 MiB ... 32 MiB  (a page holds every layer: 32 ... 512 tokens)

What matters is the unit **in tokens** (``tokens_per_unit``): a sequence wastes about half a
unit at its end. Reported per run (means over steps): ``held_utilization`` = live / (live +
end waste), memory held by running sequences; ``kv_utilization`` = live / allocated (vmem's
allocated also counts pages left mapped by deferred reclamation); ``mean_end_waste_tokens``;
mean batch; output tokens/s of the simulated deployment. A 5% admission watermark for every
policy (so they differ only in allocation). ``--quick`` simulates the first 400 requests.
"""
from __future__ import annotations

import statistics
import time

from vmemkv.benchmarks.common import (check_sim_cache_gb, environment, exit_status, format_table,
                                      print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, result_file

KiB, MiB = 2**10, 2**20
PAGED_BLOCKS = (16, 32, 128, 512, 1024)
VMEM_PAGES = {"per-layer": (64 * KiB, 256 * KiB, 2 * MiB),
              "interleaved": (2 * MiB, 8 * MiB, 32 * MiB)}
QUICK_REQUESTS, FULL_REQUESTS = 400, 2000
WATERMARK = 0.05


def configs(quick: bool = False) -> list[dict]:
    """One dict per simulated deployment: policy, layout, block_size or page_bytes."""
    out = [{"policy": "paged", "layout": "per-layer", "block_size": b} for b in PAGED_BLOCKS]
    for layout, sizes in VMEM_PAGES.items():
        out.extend({"policy": "vmem", "layout": layout, "page_bytes": p} for p in sizes)
    return out


def _label(cfg: dict) -> str:
    if cfg["policy"] == "paged":
        return f"paged {cfg['block_size']}"
    size = cfg["page_bytes"]
    return f"vmem {cfg['layout']} {size // MiB} MiB" if size >= MiB else f"vmem {cfg['layout']} {size // KiB} KiB"


def simulate_one(entries, cfg: dict, cache_gb: float, repeats: int) -> dict:
    """Simulate ``entries`` under ``cfg``; the figures are deterministic, wall time is a median."""
    from vmemkv.scheduler.scheduler import SchedulerConfig
    from vmemkv.scheduler.simulator import SimConfig, simulate
    options = {k: v for k, v in cfg.items() if k != "policy"}
    config = SimConfig(policy=cfg["policy"], cache_bytes=int(cache_gb * 1e9),
                       scheduler=SchedulerConfig(watermark=WATERMARK), **options)
    walls, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = simulate(entries, config)
        walls.append(time.perf_counter() - start)
    manager = config.make_manager()
    tokens = cfg.get("block_size") or manager.tokens_per_page
    return {"label": _label(cfg), **cfg, "tokens_per_unit": tokens, "cache_gb": cache_gb,
            "held_utilization": result.held_utilization, "kv_utilization": result.kv_utilization,
            "mean_end_waste_tokens": result.mean_end_waste_tokens, "mean_batch": result.mean_batch,
            "output_tokens_per_s": result.output_tokens_per_s,
            "num_preemptions": result.num_preemptions, "sim_wall_s": statistics.median(walls)}


def run(quick: bool = False, out: str | None = None, device: str | None = None,
        progress=None, cache_gb: float = 20.0, requests: int | None = None) -> dict:
    """``device`` is accepted for the suite's sake: this section is pure Python on the CPU.
    ``requests``: simulate only the workload's first N requests (default: by ``quick``)."""
    from vmemkv.benchmarks.suite import versions
    from vmemkv.scheduler.workload import WorkloadSpec, generate
    num_requests = requests or (QUICK_REQUESTS if quick else FULL_REQUESTS)
    repeats = 1   # the figures are deterministic (fixed seed); only sim_wall_s varies
    entries = generate(WorkloadSpec())[:num_requests]
    env = environment(seed=0, warmup=0, repeats=repeats, workload="standard log-normal",
                      requests=num_requests, cache_gb=cache_gb, model="llama-3-8b",
                      sim_device="h100", watermark=WATERMARK,
                      backends="none (simulated allocation; no attention runs)",
                      **versions("cpu"))   # kernel, load_1min: every section's header has them
    print_environment(env)
    rows = []
    for cfg in configs(quick):
        rows.append(simulate_one(entries, cfg, cache_gb, repeats))
        if progress:
            progress(f"memory {rows[-1]['label']}")
    table = [dict(r, held_util_pct=100 * r["held_utilization"], kv_util_pct=100 * r["kv_utilization"])
             for r in rows]
    print(format_table(table, ["label", "tokens_per_unit", "held_util_pct", "kv_util_pct",
                               "mean_end_waste_tokens", "mean_batch", "output_tokens_per_s",
                               "num_preemptions"]))
    payload = {"benchmark": "memory", "environment": env, "results": rows}
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_REQUESTS} requests only")
    parser.add_argument("--cache-gb", type=POSITIVE_FLOAT, default=20.0, help="simulated KV cache, GB")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here")
    args = parser.parse_args(argv)
    check_sim_cache_gb(parser, args.cache_gb)
    run(args.quick, args.out, cache_gb=args.cache_gb)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("memory", main))
