"""vmem layouts on the simulator: what ``layout="auto"`` picks and the figures its rule rests on.

    python -m vmemkv.benchmarks.layouts [--requests 300] [--out bench_out/layouts.json]

The configuration of issue 28: the Mooncake conversation trace (first ``--requests`` requests,
replayed 8x as fast, scaled to 4,096 tokens), one H100, 20 GB of KV, LRU prefix retention,
everything else ``vmemkv simulate``'s defaults (the same parser builds every run). Two tables:

* ``pages``: Llama-3-8B on vmem per-layer and interleaved at 64 KiB - 2 MiB pages: page group
  size in tokens, prefix hit rate, memory held live (live / (live + end waste)), live /
  allocated (which also counts pages kept mapped under idle slots for reuse), end waste per
  sequence, page map operations;
* ``presets``: llama-3-8b, phi-2 and gemma-3-27b on 2 MiB pages: paged-16, per-layer,
  interleaved and auto (what it resolved to): hit rate, utilisations, end waste, output tok/s.

Deterministic (no timing): every figure is the simulator's, the same on any machine.
"""
from __future__ import annotations

import argparse
import sys

from vmemkv.benchmarks.common import exit_status, format_table, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import POSITIVE_INT, result_file

PAGES = ("64KiB", "256KiB", "512KiB", "2MiB")
PRESETS = ("llama-3-8b", "phi-2", "gemma-3-27b")
POLICIES = {"paged-16": ["--policy", "paged", "--block-size", "16"],
            "per-layer": ["--policy", "vmem", "--layout", "per-layer"],
            "interleaved": ["--policy", "vmem", "--layout", "interleaved"],
            "auto": ["--policy", "vmem", "--layout", "auto"]}
COLUMNS = ("model", "page", "layout", "group_tokens", "hit_rate", "held_live", "live_allocated",
           "end_waste_tokens", "map_ops", "output_tok_s")


def run(requests: int, model: str, page: str, policy: list) -> dict:
    """One simulation, configured exactly as ``vmemkv simulate`` would be with these flags."""
    from vmemkv.scheduler import cli
    from vmemkv.scheduler.geometry import PageGeometry
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--trace", "mooncake-conversation", "--max-requests",
                              str(requests), "--rate-scale", "8", "--gpu", "h100", "--cache-gb",
                              "20", "--prefix-eviction", "lru", "--model-preset", model,
                              "--page-size", page, "--no-progress", *policy])
    config = cli._config(args)
    r = cli._simulate(cli._entries(args, args.seed), config, args)
    vmem = config.policy == "vmem"
    layout = config.resolved_layout if vmem else "paged-16"
    return {"model": model, "page": page,
            "layout": layout + (" (auto)" if vmem and config.layout == "auto" else ""),
            "group_tokens": PageGeometry.of(config.model_spec, config.page_bytes,
                                            layout).tokens_per_page if vmem else config.block_size,
            "hit_rate": r.prefix_cache_hits / r.prefix_cache_queries,
            "held_live": r.held_utilization, "live_allocated": r.kv_utilization,
            "end_waste_tokens": r.mean_end_waste_tokens, "map_ops": r.mapped_page_ops,
            "output_tok_s": r.output_tokens_per_s}


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=POSITIVE_INT, default=300)
    p.add_argument("--out", type=result_file, help="also write JSON here")
    args = p.parse_args(argv)
    runs = [("pages", "llama-3-8b", page, POLICIES[lay]) for page in PAGES
            for lay in ("per-layer", "interleaved")]
    runs += [("presets", model, "2MiB", POLICIES[name]) for model in PRESETS for name in POLICIES]
    tables = {"pages": [], "presets": []}
    for i, (table, model, page, policy) in enumerate(runs, 1):
        sys.stderr.write(f"\r[{i}/{len(runs)}] {model} {page} {' '.join(policy[1:])}      ")
        tables[table].append(run(args.requests, model, page, policy))
    sys.stderr.write("\n")
    for name, rows in tables.items():
        print(f"\n{name}:")
        print(format_table(rows, COLUMNS))
    write_json(args.out, {"requests": args.requests, **tables})
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("layouts", main))
