"""Prefix caching across requests, end to end: multi-turn conversations on the engine with
retention off and on (each eviction policy), on vmem and paged; the speed-up is a ratio of wall
times of the same work, and the tokens must be identical.

    python -m vmemkv.benchmarks.prefix [--quick] [--device cpu|cuda] [--out bench_out/prefix.json]
    python -m vmemkv.benchmarks.prefix --trace 150 --cache-gb 60 8    # the simulator's table

``--trace N``: instead, the simulator (Llama-3-8B on one H100, prefill at 50% MFU) replays the
first N requests of the Mooncake conversation trace (scaled to 4,096 tokens) on paged-16 and
vmem interleaved with each eviction policy at each ``--cache-gb``: hit rate, prefill tokens
computed (prompt tokens - hits + recomputed), output tokens/s and TTFT p50/p90.

Set-up: the random-weight "small-llama" (runtime.models; fp32 on the CPU, fp16 on CUDA),
greedy, EOS ignored. ``conversations`` chats share one system prompt; each turn's prompt is the
previous turn's prompt + its answer + a new user message, and all chats of a turn go to one
``generate`` call (so a turn's prefix is cached only if the previous turn's requests, which have
ended, left it cached). Each configuration: one warm-up pass, then ``repeats`` passes of every
turn; the figure is the median wall time of a pass. ``hit_rate`` is prefix_cache_hits /
prefix_cache_queries (tokens), ``computed`` the tokens the steps computed, and ``speedup`` the
wall time with retention off over this row's, for the same cache.
"""
from __future__ import annotations

import os
import random

from vmemkv.benchmarks.common import (busy_warnings, check_sim_cache_gb, environment, exit_status,
                                      format_table, median_seconds, print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser, UsageError
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, POSITIVE_INT, DistinctValues, result_file

MODEL = "small-llama"
SEED = 0
# (conversations, turns, system prompt, user message, answer), in chats and tokens
QUICK, FULL = (4, 3, 64, 16, 8), (8, 4, 256, 48, 24)
COLUMNS = ("cache", "eviction", "seconds", "speedup", "hit_rate", "computed", "tokens_equal")


def workload(quick: bool) -> dict:
    chats, turns, system, user, answer = QUICK if quick else FULL
    rng = random.Random(SEED)
    words = lambda n: [rng.randrange(1, 1000) for _ in range(n)]   # noqa: E731
    return {"system": words(system), "users": [[words(user) for _ in range(chats)]
                                               for _ in range(turns)],
            "answer": answer, "max_batch": chats,
            "max_context": system + turns * (user + answer) + 16}


def converse(engine, work: dict) -> tuple:
    """Every turn of every chat; returns (answers, tokens computed, prefix hits, queries)."""
    from vmemkv.runtime.engine import SamplingParams
    params = SamplingParams(max_new_tokens=work["answer"], ignore_eos=True)
    history = [list(work["system"]) for _ in work["users"][0]]
    answers, computed, hits, queries = [], 0, 0, 0
    for users in work["users"]:
        prompts = [h + u for h, u in zip(history, users)]
        outs = engine.generate(prompts, params)
        stats = engine.last_stats
        computed += stats.computed_tokens
        hits, queries = hits + stats.prefix_cache_hits, queries + stats.prefix_cache_queries
        history = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
        answers.append([o.outputs[0].token_ids for o in outs])
    return answers, computed, hits, queries


def measure(cache: str, eviction: str, work: dict, device: str, warmup: int,
            repeats: int) -> dict:
    import torch
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.models import build_model
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = build_model(MODEL, seed=SEED, dtype=dtype, device=device)
    result = {}

    # vmem shares whole pages: 4 KiB host pages hold 16 tokens of one small-llama layer (a
    # 2 MiB CUDA page holds thousands: no prefix of this workload fills one)
    pages = {"page_bytes": 4096} if cache == "vmem" and device == "cpu" else {}

    def once() -> None:    # a fresh engine per pass: nothing cached from an earlier pass
        with Engine(model, cache=cache, max_batch=work["max_batch"],
                    max_context=work["max_context"], prefix_sharing=True,
                    prefix_eviction=eviction, block_size=16, **pages) as engine:
            result["run"] = converse(engine, work)

    seconds = median_seconds(once, warmup, repeats)
    answers, computed, hits, queries = result["run"]
    return {"cache": cache, "eviction": eviction, "seconds": seconds, "answers": answers,
            "hit_rate": hits / queries if queries else 0.0, "computed": computed}


def run(quick: bool, device: str, warmup: int, repeats: int, policies=None) -> list:
    """Rows for retention ``off`` and each of ``policies`` (default: every eviction policy)."""
    from vmemkv.scheduler.managers import EVICTION_POLICIES
    work = workload(quick)
    wanted = ["off"] + [p for p in (policies or EVICTION_POLICIES) if p != "off"]
    rows = []
    for cache in ("vmem", "paged"):
        group = [measure(cache, e, work, device, warmup, repeats) for e in wanted]
        base = next(r for r in group if r["eviction"] == "off")
        for r in group:
            r["speedup"] = base["seconds"] / r["seconds"]
            r["tokens_equal"] = r["answers"] == base["answers"]
        for r in group:
            del r["answers"]
        if not all(r["tokens_equal"] for r in group):   # checked before anything is reported
            raise RuntimeError(f"{cache}: greedy tokens differ with retention on and off")
        rows += group
    return rows


TRACE_COLUMNS = ("cache_gb", "layout", "eviction", "hit_rate", "prefill_tokens",
                 "output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "wall_s")


def trace_rows(requests: int, cache_gbs) -> list:
    """The simulator's rows (see the module docstring); every run is deterministic."""
    from vmemkv.scheduler.managers import EVICTION_POLICIES
    from vmemkv.scheduler.simulator import SimConfig, simulate
    from vmemkv.scheduler.traces import fit_to_length, load_trace
    entries, _ = fit_to_length(load_trace("mooncake-conversation", max_requests=requests), 4096)
    layouts = {"paged-16": dict(policy="paged", block_size=16),
               "vmem interleaved": dict(policy="vmem", layout="interleaved")}
    rows = []
    for gb in cache_gbs:
        for name, layout in layouts.items():
            for eviction in EVICTION_POLICIES:
                r = simulate(entries, SimConfig(cache_bytes=int(gb * 1e9), prefill_mfu=0.5,
                                                prefix_eviction=eviction, **layout))
                rows.append({"cache_gb": gb, "layout": name, "eviction": eviction,
                             "hit_rate": r.prefix_cache_hits / r.prefix_cache_queries,
                             "prefill_tokens": r.prefix_cache_queries - r.prefix_cache_hits
                             + r.recomputed_tokens,
                             "output_tok_s": r.output_tokens_per_s,
                             "ttft_p50_ms": r.serving["median_ttft_ms"],
                             "ttft_p90_ms": r.serving["p90_ttft_ms"],
                             "wall_s": r.wall_seconds})
    return rows


def _ignored_flag(args) -> str | None:
    """A flag the chosen run would not read, named, or None: ``--trace`` runs the simulator
    only (--quick, --device and --repeats were dropped in silence), and --cache-gb sizes
    only its cache (without --trace it did nothing)."""
    if args.trace:
        given = [flag for flag, value in (("--quick", args.quick), ("--device", args.device),
                                          ("--repeats", args.repeats)) if value]
        return (f"{given[0]} sets the engine run and --trace runs the simulator, which would "
                f"ignore it: drop it") if given else None
    return None if args.cache_gb is None else ("--cache-gb sizes the simulator's cache: it "
                                               "applies with --trace")


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller workload (seconds)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=None, help="(default: 3)")
    p.add_argument("--out", type=result_file, help="also write JSON here")
    p.add_argument("--trace", type=POSITIVE_INT, metavar="N", help="the simulator's table over N requests")
    p.add_argument("--cache-gb", type=POSITIVE_FLOAT, nargs="+", default=None,
                   action=DistinctValues, help="with --trace (default: 60 8)")
    args = p.parse_args(argv)
    problem = _ignored_flag(args)
    if problem:
        p.error(problem)
    for gb in args.cache_gb or ():
        check_sim_cache_gb(p, gb)
    if args.trace:
        rows = trace_rows(args.trace, args.cache_gb or [60.0, 8.0])
        print(format_table(rows, TRACE_COLUMNS))
        write_json(args.out, {"requests": args.trace, "rows": rows})
        return 0
    import torch
    from vmemkv.runtime.models import checked_device
    device, repeats = args.device or "cpu", args.repeats or 3
    checked_device(device, "--device", UsageError)   # cuda on a CPU machine: AssertionError
    torch.set_num_threads(1)
    env = environment(SEED, 1, repeats, device, model=MODEL, quick=args.quick,
                      load_1min=round(os.getloadavg()[0], 2))
    print_environment(env)
    rows = run(args.quick, device, 1, repeats)
    print(format_table(rows, COLUMNS))
    write_json(args.out, {"environment": env, "rows": rows,
                          "warnings": busy_warnings(env["load_1min"])})
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("prefix", main))
