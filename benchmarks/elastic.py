"""Two models in one process on one KV budget: a shared MemoryBudget against a static 50/50
split, on a bursty two-model workload, in one run (issue 32).

    python -m vmemkv.benchmarks.elastic [--quick] [--out bench_out/elastic.json]

Set-up: two random-weight models of different families (runtime.models "tiny-llama" and
"tiny-qwen2": 512 bytes of K/V a token each), vmem per-layer caches on 4 KiB pages, greedy, EOS
ignored. The workload: each model gets bursts of requests (Poisson arrivals at ``burst_rate``
for ``burst_s``), the two models' bursts out of phase (B's start when A's are over), prompts
and outputs uniform in the ranges below, seeded. Both arms replay the same arrivals, one loop
stepping whichever engine has work:

    static   each engine a fixed cache of total/2 bytes
    shared   one MemoryBudget(total): each engine starts at total/2, keeps min total/8 and may
             grow to total - total/8 (the other's minimum); an idle engine gives its pages back
             after ``idle_release_s`` (the loop calls ``rebalance_memory`` on idle engines)

The replay runs on a step clock, not the wall clock: each turn of the loop (one step of each
engine with work) is ``STEP_S`` of trace time, and the trace jumps to the next arrival when
both engines are idle; the budget's idle clock is the same. So how many requests wait for memory
does not depend on how fast this machine steps (on the wall clock it did: the first runs, at a
few ms a step, measured TTFT p90 7.3x lower shared; two days of engine speed-ups later the same
script measured 0.9x, every request admitted at once), and one run is exact: the figures are
deterministic. TTFT = the trace time of the turn that gave a request its first token - its
arrival, in turns (steps) and in trace seconds. ``tokens_identical``: every request's tokens in
both arms equal that model's solo run (alone, with room for every request). ``wall_s``: the
arm's wall time on this machine, for scale only.
"""
from __future__ import annotations

import random
import time

from vmemkv.benchmarks.common import environment, exit_status, format_table, print_environment, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import NON_NEGATIVE_INT, result_file

KiB = 2**10
MODELS = ("tiny-llama", "tiny-qwen2")
PAGE_BYTES = 4 * KiB
FULL = dict(total_kib=1024, bursts=2, burst_s=0.4, burst_rate=60.0, gap_s=1.0,
            prompt=(48, 128), output=(32, 96), idle_release_s=0.2)
QUICK = dict(total_kib=512, bursts=1, burst_s=0.2, burst_rate=60.0, gap_s=0.5,
             prompt=(32, 96), output=(16, 48), idle_release_s=0.1)
STEP_S = 0.005   # trace seconds a turn of the loop stands for (a few ms: a step of these models)
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


def _engines(arm: str, shape: dict, models: list, clock):
    from vmemkv.runtime.engine import Engine
    from vmemkv.scheduler.budget import MemoryBudget
    total = shape["total_kib"] * KiB
    if arm == "static":
        return [Engine(m, cache_bytes=total // 2, **ENGINE) for m in models], None
    budget = MemoryBudget(total, idle_release_s=shape["idle_release_s"], clock=clock)
    return [Engine(m, memory_budget=budget, cache_bytes=total // 2, min_cache_bytes=total // 8,
                   max_cache_bytes=total - total // 8, **ENGINE) for m in models], budget


def run_arm(arm: str, shape: dict, models: list, requests: list) -> dict:
    """Replay ``requests`` on the step clock on the arm's two engines; per-request tokens and
    TTFT (trace seconds)."""
    from vmemkv.runtime.engine import SamplingParams
    now = [0.0]
    engines, budget = _engines(arm, shape, models, clock=lambda: now[0])
    ids, first = [None] * len(requests), [None] * len(requests)
    peak, turns, waiting = [0, 0], 0, []
    try:
        wall_start, nxt = time.perf_counter(), 0
        while nxt < len(requests) or any(e.has_unfinished() for e in engines):
            if nxt < len(requests) and not any(e.has_unfinished() for e in engines):
                now[0] = max(now[0], requests[nxt][0])       # idle: on to the next arrival
            while nxt < len(requests) and requests[nxt][0] <= now[0]:
                _, m, prompt, new = requests[nxt]
                ids[nxt] = (m, engines[m].add_request(
                    prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
                waiting.append(nxt)
                nxt += 1
            for i, engine in enumerate(engines):
                if engine.has_unfinished():
                    engine.step()
                else:
                    engine.rebalance_memory()
                peak[i] = max(peak[i], engine.cache_bytes)
            if budget is not None:
                assert budget.held_bytes <= budget.total_bytes
            now[0] += STEP_S
            turns += 1
            for k in [k for k in waiting if engines[ids[k][0]].output(ids[k][1]).outputs[0]
                      .token_ids]:
                first[k] = now[0]
                waiting.remove(k)
        wall = time.perf_counter() - wall_start
        outs = [engines[m].output(rid, pop=True) for m, rid in ids]
        stats = budget.stats() if budget is not None else None
    finally:
        for engine in engines:
            engine.close()
    ttft = [[], []]
    for k, ((m, _), at) in enumerate(zip(ids, first)):
        ttft[m].append(at - requests[k][0])
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    p90 = _p90(ttft[0] + ttft[1])
    row = dict(arm=arm, ttft_p90_s=p90, ttft_p90_steps=round(p90 / STEP_S),
               **{f"ttft_p90_{MODELS[m]}_s": _p90(ttft[m]) for m in range(2)},
               throughput_tok_per_trace_s=tokens / now[0], trace_s=now[0], turns=turns,
               **{f"peak_KiB_{MODELS[m]}": peak[m] // KiB for m in range(2)}, wall_s=wall)
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


def run(quick: bool = False, seed: int = 0, out: str | None = None) -> dict:
    import torch
    from vmemkv.runtime.models import build_model
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    models = [build_model(name, seed=0) for name in MODELS]
    requests = workload(shape, seed)
    env = environment(seed, warmup=0, repeats=1, models="+".join(MODELS),
                      requests=len(requests), total_KiB=shape["total_kib"], step_s=STEP_S)
    print_environment(env)
    solo = solo_tokens(models, requests)
    rows, identical = [], True
    for arm in ("static", "shared"):
        res = run_arm(arm, shape, models, requests)
        identical &= res["tokens"] == solo
        rows.append(res["row"])
        print(f"# {arm}: ttft p90 {res['row']['ttft_p90_steps']} steps, {res['row']['turns']} "
              f"turns, {res['row']['wall_s']:.1f} s wall", flush=True)
    static, shared = rows
    ratios = dict(ttft_p90_static_over_shared=static["ttft_p90_s"] / shared["ttft_p90_s"],
                  throughput_shared_over_static=shared["throughput_tok_per_trace_s"]
                  / static["throughput_tok_per_trace_s"])
    columns = ["arm", "ttft_p90_steps", "ttft_p90_s", f"ttft_p90_{MODELS[0]}_s",
               f"ttft_p90_{MODELS[1]}_s", "throughput_tok_per_trace_s",
               f"peak_KiB_{MODELS[0]}", f"peak_KiB_{MODELS[1]}", "trace_s"]
    print(format_table(rows, columns))
    print(f"# TTFT p90 static/shared {ratios['ttft_p90_static_over_shared']:.2f}x, throughput "
          f"shared/static {ratios['throughput_shared_over_static']:.2f}x (trace time, "
          f"{STEP_S * 1000:g} ms a step); tokens identical to each model's solo run: {identical}")
    payload = dict(environment=env, shape=shape, step_s=STEP_S, rows=rows, ratios=ratios,
                   tokens_identical=identical)
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    parser.add_argument("--out", default=None, type=result_file, help="JSON file (written whole or not at all)")
    args = parser.parse_args(argv)
    payload = run(args.quick, args.seed, args.out)
    return 0 if payload["tokens_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(exit_status("elastic", main))
