"""Per-request timing trace of one fidelity comparison: where each request's TTFT goes, in the
engine and in the simulator, for the same requests (a diagnostic; nothing here runs in a
normal fidelity run or in the engine's hot path).

    .venv/bin/python benchmarks/fidelity_trace.py --profile profile.json --rate-scale 4 \
        [--requests 64] [--out trace.json]

For each request, on each side: the trace arrival, when it was submitted (engine: the replay
loop's lag behind the arrival; simulator: never late), the start of the first step that
computed its tokens, and its first token (the end of the step that sampled it); and for each
step the engine ran, its measured seconds beside what the profile charges for that same step.
The summary prints medians of: arrival -> first step start (the wait), first step start ->
first token, TTFT, the engine's submission lag, and the profile's error on the engine's steps
with prompt tokens only, with prompt tokens beside decodes (mixed), its cold decodes and its
warm decodes.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Dict, List

from vmemkv.benchmarks.fidelity import (MAX_BATCH, MODEL, SEED, profile_problem, replay_engine,
                                        sim_config, workload)
from vmemkv.benchmarks.common import exit_status
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cost import AfterPrefill, prefill_pairs
from vmemkv.scheduler.profile_cost import load_profile, profile_cost
from vmemkv.scheduler.result_files import write_json
from vmemkv.scheduler.simulator import Simulator
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, POSITIVE_INT, result_file, thread_count


def tap_plans(scheduler, steps: List[Dict], clock) -> None:
    """Record every plan ``scheduler.schedule()`` makes, with the clock at the call (a
    read-only tap: the plan is returned unchanged). ``untap(scheduler)`` removes it."""
    schedule = scheduler.schedule

    def recording_schedule():
        start = clock()
        plan = schedule()
        steps.append({"start_s": start, "new_tokens": plan.num_new_tokens,
                      "context_tokens": plan.num_context_tokens, "num_seqs": len(plan.seqs),
                      "prefill_pairs": prefill_pairs(plan.seqs),
                      "seqs": [(s.seq_id, s.num_new_tokens, s.sample) for s in plan.seqs]})
        return plan
    scheduler.schedule = recording_schedule


def untap(scheduler) -> None:
    del scheduler.schedule                    # back to the class's method


class TracingSimulator(Simulator):
    """A Simulator whose every step is recorded (start, end in simulated seconds, its seqs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: List[Dict] = []

    def _step(self, sched, now, token_times, after_idle=False):
        tap_plans(sched, self.steps, lambda: now)
        try:
            out = super()._step(sched, now, token_times, after_idle)
        finally:
            untap(sched)
        self.steps[-1]["end_s"] = now + out[0]
        return out


def per_request(steps: List[Dict], seq_to_index: Dict[int, int], arrivals: List[float],
                first_tokens: List[float]) -> List[Dict]:
    """For each request: arrival, first step start, first token, wait and prefill seconds."""
    first_step: Dict[int, float] = {}
    for step in steps:
        for seq_id, new, _ in step["seqs"]:
            i = seq_to_index.get(seq_id)
            if i is not None and new and i not in first_step:
                first_step[i] = step["start_s"]
    return [{"arrival_s": a, "first_step_s": first_step[i], "first_token_s": t,
             "wait_s": first_step[i] - a, "to_token_s": t - first_step[i], "ttft_s": t - a}
            for i, (a, t) in enumerate(zip(arrivals, first_tokens))]


def run_engine(args, entries):
    """The engine replay, traced: (requests, steps with measured seconds, submission lags)."""
    import torch
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import build_model
    torch.set_num_threads(args.threads)
    model = build_model(MODEL, seed=SEED)
    with Engine(model, max_batch=MAX_BATCH, max_context=args.max_context) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))      # warm-up
        steps: List[Dict] = []
        timings, lags = replay_engine(engine, entries, model.config.vocab_size, steps)
        config = sim_config(engine, args.profile)
    first_seq = min(seq_id for step in steps for seq_id, _, _ in step["seqs"])
    seqs = {first_seq + i: i for i in range(len(entries))}
    reqs = per_request(steps, seqs, [t.arrival_s for t in timings],
                       [t.token_times_s[0] for t in timings])
    return reqs, steps, lags, config


def summary(name: str, reqs: List[Dict]) -> Dict[str, float]:
    med = {k: statistics.median(r[k] for r in reqs) * 1e3
           for k in ("wait_s", "to_token_s", "ttft_s")}
    p90 = statistics.quantiles([r["ttft_s"] for r in reqs], n=10)[-1] * 1e3
    print(f"{name:<10} median wait {med['wait_s']:7.2f} ms  first step -> token "
          f"{med['to_token_s']:7.2f} ms  TTFT p50 {med['ttft_s']:7.2f} p90 {p90:7.2f} ms")
    return {**med, "ttft_p90_ms": p90}


def step_kind(step: Dict, cold: bool) -> str:
    """prefill (prompt tokens only), mixed (prompt tokens beside decodes), cold_decode or
    warm_decode."""
    if step["prefill_pairs"]:
        decodes = sum(1 for _, new, _ in step["seqs"] if new == 1)
        return "mixed" if decodes else "prefill"
    return "cold_decode" if cold else "warm_decode"


def step_errors(steps: List[Dict], cost) -> Dict[str, float]:
    """The profile's median relative error on the engine's own steps: prompt tokens only,
    prompt tokens beside decodes (mixed), cold decodes (``AfterPrefill``), warm decodes."""
    after = AfterPrefill()
    errs = {"prefill": [], "mixed": [], "cold_decode": [], "warm_decode": []}
    for s in steps:
        cold = after.cold(s["prefill_pairs"], s["num_seqs"])
        if s["num_seqs"]:
            kind = step_kind(s, cold)
            predicted = cost.step_seconds(s["context_tokens"], s["new_tokens"], 0,
                                          s["num_seqs"], s["prefill_pairs"], cold,
                                          s["after_idle"])
            errs[kind].append((predicted - s["seconds"]) / s["seconds"])
    out = {}
    for kind, e in errs.items():
        out[f"{kind}_steps"] = len(e)
        out[f"{kind}_median_rel_error"] = statistics.median(e) if e else float("nan")
    return out


def main(argv=None) -> int:
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--requests", type=POSITIVE_INT, default=64)
    ap.add_argument("--rate-scale", type=POSITIVE_FLOAT, default=4.0)
    ap.add_argument("--length-scale", type=POSITIVE_FLOAT, default=0.25)
    ap.add_argument("--max-context", type=POSITIVE_INT, default=512)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--out", type=result_file, help="write every request and step here (JSON)")
    args = ap.parse_args(argv)
    problem = profile_problem(args.profile)     # it failed after the replay, minutes in
    if problem:
        ap.error(problem)
    entries = workload(args)
    eng_reqs, eng_steps, lags, config = run_engine(args, entries)
    manager = config.make_manager()
    sim = TracingSimulator(manager, config.make_cost(manager.pages_per_map_op),
                           config.scheduler_for(manager))
    result = sim.run(entries)
    sim_reqs = per_request(sim.steps, {i: i for i in range(len(entries))},
                           [t.arrival_s for t in result.timings],
                           [t.token_times_s[0] for t in result.timings])
    out = {"engine": summary("engine", eng_reqs), "simulator": summary("simulator", sim_reqs),
           "lag_median_ms": statistics.median(lags) * 1e3, "lag_max_ms": max(lags) * 1e3,
           **step_errors(eng_steps, profile_cost(load_profile(args.profile)))}
    print(json.dumps(out))
    if args.out:
        write_json(args.out, {**out, "engine_requests": eng_reqs, "simulator_requests": sim_reqs,
                              "engine_steps": eng_steps, "simulator_steps": sim.steps}, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status("fidelity_trace", main))
