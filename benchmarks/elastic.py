"""Two models in one process on one KV budget: a shared MemoryBudget against a static 50/50
split, on a bursty two-model workload, in one run (issue 32).

    python -m vmemkv.benchmarks.elastic [--quick] [--repeats N] [--out bench_out/elastic.json]

Set-up: two random-weight models of different families (runtime.models "tiny-llama" and
"tiny-qwen2": 512 bytes of K/V a token each), vmem per-layer caches on 4 KiB pages, greedy, EOS
ignored. The workload: each model gets bursts of requests (Poisson arrivals at ``burst_rate``
for ``burst_s``), the two models' bursts out of phase (B's start when A's are over), prompts
and outputs uniform in the ranges below, seeded. Both arms replay the same arrivals in wall
time, one loop stepping whichever engine has work:

    static   each engine a fixed cache of total/2 bytes
    shared   one MemoryBudget(total): each engine starts at total/2, keeps min total/8 and may
             grow to total - total/8 (the other's minimum); an idle engine gives its pages back
             after ``idle_release_s`` (the loop calls ``rebalance_memory`` on idle engines)

TTFT = first token's time - the request's submission (the loop submits a request the first
time round after its arrival; a step is a few ms). Throughput = output tokens of both models
over the arm's wall time. ``tokens_identical``: every request's tokens in both arms equal that
model's solo run (alone, with room for every request). Wall-clock figures move with the
machine's load: the ratios are of arms run back to back in one process, ``--repeats`` rounds
alternating the order, the median reported.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from vmemkv.benchmarks.common import environment, format_table, print_environment, write_json

KiB = 2**10
MODELS = ("tiny-llama", "tiny-qwen2")
PAGE_BYTES = 4 * KiB
FULL = dict(total_kib=1024, bursts=2, burst_s=0.4, burst_rate=60.0, gap_s=1.0,
            prompt=(48, 128), output=(32, 96), idle_release_s=0.2)
QUICK = dict(total_kib=512, bursts=1, burst_s=0.2, burst_rate=60.0, gap_s=0.5,
             prompt=(32, 96), output=(16, 48), idle_release_s=0.1)
ENGINE = dict(max_batch=16, max_context=256, layout="per-layer", page_bytes=PAGE_BYTES,
              self_check=False)


def workload(shape: dict, seed: int) -> list:
    """[(arrival_s, model index, prompt ids, max_new_tokens)], arrivals sorted: model m's
    burst k starts at (2k + m) * (burst_s + gap_s)."""
    rng = random.Random(seed)
    period = shape["burst_s"] + shape["gap_s"]
    out = []
    for k in range(shape["bursts"]):
        for m in range(len(MODELS)):
            start = (2 * k + m) * period
            t = start + rng.expovariate(shape["burst_rate"])
            while t < start + shape["burst_s"]:
                prompt = [rng.randrange(256) for _ in range(rng.randint(*shape["prompt"]))]
                out.append((t, m, prompt, rng.randint(*shape["output"])))
                t += rng.expovariate(shape["burst_rate"])
    return sorted(out, key=lambda r: r[0])


def _engines(arm: str, shape: dict, models: list):
    from vmemkv.runtime.engine import Engine
    from vmemkv.scheduler.budget import MemoryBudget
    total = shape["total_kib"] * KiB
    if arm == "static":
        return [Engine(m, cache_bytes=total // 2, **ENGINE) for m in models], None
    budget = MemoryBudget(total, idle_release_s=shape["idle_release_s"])
    return [Engine(m, memory_budget=budget, cache_bytes=total // 2, min_cache_bytes=total // 8,
                   max_cache_bytes=total - total // 8, **ENGINE) for m in models], budget


def run_arm(arm: str, shape: dict, models: list, requests: list) -> dict:
    """Replay ``requests`` in wall time on the arm's two engines; per-request tokens and TTFT."""
    from vmemkv.runtime.engine import SamplingParams
    engines, budget = _engines(arm, shape, models)
    ids = [None] * len(requests)
    peak = [0, 0]
    try:
        start, nxt = time.perf_counter(), 0
        while nxt < len(requests) or any(e.has_unfinished() for e in engines):
            now = time.perf_counter() - start
            while nxt < len(requests) and requests[nxt][0] <= now:
                _, m, prompt, new = requests[nxt]
                ids[nxt] = (m, engines[m].add_request(
                    prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
                nxt += 1
            busy = False
            for i, engine in enumerate(engines):
                if engine.has_unfinished():
                    engine.step()
                    busy = True
                else:
                    engine.rebalance_memory()
                peak[i] = max(peak[i], engine.cache_bytes)
            if budget is not None:
                assert budget.held_bytes <= budget.total_bytes
            if not busy and nxt < len(requests):
                time.sleep(max(0.0, min(0.005, requests[nxt][0] - now)))
        wall = time.perf_counter() - start
        outs = [engines[m].output(rid, pop=True) for m, rid in ids]
        stats = budget.stats() if budget is not None else None
    finally:
        for engine in engines:
            engine.close()
    ttft = [[], []]
    for (m, _), out in zip(ids, outs):
        ttft[m].append(out.outputs[0].token_times_s[0] - out.arrival_s)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = dict(arm=arm, wall_s=wall, throughput_tok_s=tokens / wall,
               ttft_p90_s=_p90(ttft[0] + ttft[1]),
               **{f"ttft_p90_{MODELS[m]}_s": _p90(ttft[m]) for m in range(2)},
               **{f"peak_KiB_{MODELS[m]}": peak[m] // KiB for m in range(2)})
    if stats is not None:
        row["grows"] = sum(s.grows for s in stats["shares"].values())
        row["gives"] = sum(s.gives for s in stats["shares"].values())
    return dict(row=row, tokens=[o.outputs[0].token_ids for o in outs])


def _p90(values: list) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else float("nan")


def solo_tokens(models: list, requests: list) -> list:
    """Each model alone with room for all its requests: the tokens the arms must equal."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    out = [None] * len(requests)
    for m, mod in enumerate(models):
        mine = [i for i, r in enumerate(requests) if r[1] == m]
        with Engine(mod, cache_bytes=ENGINE["max_batch"] * ENGINE["max_context"] * 512,
                    **ENGINE) as engine:
            res = engine.generate([requests[i][2] for i in mine],
                                  [SamplingParams(max_new_tokens=requests[i][3], ignore_eos=True)
                                   for i in mine])
        for i, o in zip(mine, res):
            out[i] = o.outputs[0].token_ids
    return out


def run(quick: bool = False, repeats: int = 3, seed: int = 0, out: str | None = None) -> dict:
    import torch
    from vmemkv.runtime.models import build_model
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    models = [build_model(name, seed=0) for name in MODELS]
    requests = workload(shape, seed)
    env = environment(seed, warmup=0, repeats=repeats, models="+".join(MODELS),
                      requests=len(requests), total_KiB=shape["total_kib"])
    print_environment(env)
    solo = solo_tokens(models, requests)
    rounds, identical = [], True
    for r in range(repeats):
        order = ("static", "shared") if r % 2 == 0 else ("shared", "static")
        got = {}
        for arm in order:
            res = run_arm(arm, shape, models, requests)
            identical &= res["tokens"] == solo
            got[arm] = res["row"]
            print(f"# round {r + 1}/{repeats} {arm}: ttft p90 {res['row']['ttft_p90_s']:.3f} s, "
                  f"{res['row']['throughput_tok_s']:.0f} tok/s", flush=True)
        rounds.append(got)
    rows = []
    for arm in ("static", "shared"):
        runs = [g[arm] for g in rounds]
        row = {k: statistics.median(x[k] for x in runs) if isinstance(runs[0][k], (int, float))
               else runs[0][k] for k in runs[0]}
        rows.append(row)
    static, shared = rows
    ratios = dict(ttft_p90_static_over_shared=static["ttft_p90_s"] / shared["ttft_p90_s"],
                  throughput_shared_over_static=shared["throughput_tok_s"]
                  / static["throughput_tok_s"])
    columns = ["arm", "ttft_p90_s", f"ttft_p90_{MODELS[0]}_s", f"ttft_p90_{MODELS[1]}_s",
               "throughput_tok_s", f"peak_KiB_{MODELS[0]}", f"peak_KiB_{MODELS[1]}", "wall_s"]
    print(format_table(rows, columns))
    print(f"# TTFT p90 static/shared {ratios['ttft_p90_static_over_shared']:.2f}x, throughput "
          f"shared/static {ratios['throughput_shared_over_static']:.2f}x (medians of {repeats} "
          f"rounds); tokens identical to each model's solo run: {identical}")
    payload = dict(environment=env, shape=shape, rows=rows, rounds=rounds, ratios=ratios,
                   tokens_identical=identical)
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both arms (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file (written whole or not at all)")
    args = parser.parse_args(argv)
    payload = run(args.quick, args.repeats, args.seed, args.out)
    return 0 if payload["tokens_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
