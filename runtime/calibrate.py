"""``vmemkv calibrate``: time the real engine's steps on this machine, fit a device profile.

For each (batch, context) point: ``batch`` prompts of ``context`` tokens go through an engine,
and every step is timed (wall seconds around ``Engine.step``) with the plan's new and context
token counts (read from the scheduler's own plan: the step's work exactly). Prefill steps give
many new tokens, decode steps ``batch`` new tokens over ~``batch * context`` context tokens.
A median regression of seconds = base + s * sequences + a * new + b * context + q * prefill
pairs (``scheduler.cost.prefill_pairs``: prefill's quadratic attention) + r * new² + f * (a step
with prefill) + w * cold (the first decodes after a prefill, ``scheduler.cost.AfterPrefill``)
+ i * (the first step after idle) over every timed step
(after a warm-up generate) gives the coefficients of
``vmemkv.scheduler.profile_cost``; the profile records the points and the fit's error.

    vmemkv calibrate --model small-llama --batches 1 4 16 --contexts 64 256 --out profile.json
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Dict, List, Sequence

from vmemkv.scheduler.cost import AfterPrefill, prefill_pairs
from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT
from vmemkv.scheduler.result_files import write_json

PREFILL_LENGTHS = (32, 64, 96, 128, 192, 256, 320, 384, 448)   # single prompts timed beside
                                                               # the grid, tokens
IDLE_S = 0.02       # sleep before the second run of each single prompt (after_idle)


def model_entry(model, name: str) -> dict:
    """The ModelSpec fields of a torch model (what the simulator's managers size memory for)."""
    from vmemkv.runtime.hf.support import kv_shape_of
    param = next(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(name=name, dtype_bytes=param.element_size(), weight_bytes=weight_bytes,
                num_params=sum(p.numel() for p in model.parameters()), **kv_shape_of(model.config))


def time_steps(engine, prompts: List[List[int]], new_tokens: int,
               idle_s: float = 0.0) -> List[Dict]:
    """Every step of generating ``new_tokens`` for ``prompts``: its new and context tokens,
    prefill pairs, whether it is a cold step (from the plan the scheduler made) or the first
    after ``idle_s`` seconds of sleep (``after_idle``; 0: none), and its wall seconds."""
    from vmemkv.runtime.engine import SamplingParams
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rids = [engine.add_request(prompt, params) for prompt in prompts]
    engine.scheduler.schedule = recording_schedule      # read-only tap on the plans
    points, after_prefill = [], AfterPrefill()
    if idle_s:
        time.sleep(idle_s)
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            plan = plans[-1]
            pairs = prefill_pairs(plan.seqs)
            cold = after_prefill.cold(pairs, len(plan.seqs))
            if plan.seqs:
                points.append({"batch": len(plan.seqs), "new_tokens": plan.num_new_tokens,
                               "context_tokens": plan.num_context_tokens,
                               "prefill_pairs": pairs, "cold_step": int(cold),
                               "after_idle": int(bool(idle_s) and not points), "seconds": seconds})
    finally:
        del engine.scheduler.schedule                     # back to the class's method
    for rid in rids:
        engine.output(rid, pop=True)
    return points


def fit(points: Sequence[Dict], iterations: int = 50) -> Dict[str, float]:
    """Coefficients (clipped at 0) of seconds against sequences, new and context tokens,
    prefill pairs, new tokens squared, prefill steps, cold steps and steps after idle (0 for a
    point that lacks them; in the order of ``profile_cost.FITTED``) that minimise the summed
    ABSOLUTE error: a median regression (iteratively reweighted least squares). On a shared
    machine a step is sometimes descheduled and takes several times its cost; such steps move
    a least-squares fit, and a relative-error fit chases the fastest steps (measured: it
    under-charged decodes by 25-40%), but a median fit follows the typical step, which is what
    a replay sees."""
    import numpy as np
    x = np.array([[1.0, p["batch"], p["new_tokens"], p["context_tokens"],
                   p.get("prefill_pairs", 0), p["new_tokens"] ** 2,
                   float(p.get("prefill_pairs", 0) > 0), p.get("cold_step", 0),
                   p.get("after_idle", 0)] for p in points])
    y = np.array([p["seconds"] for p in points])
    weight = np.ones_like(y)
    for _ in range(iterations):
        coef, *_ = np.linalg.lstsq(x * weight[:, None], y * weight, rcond=None)
        weight = 1.0 / np.sqrt(np.maximum(np.abs(x @ coef - y), 1e-6))
    return dict(zip(FITTED, (max(0.0, float(c)) for c in coef)))


def fit_error(points: Sequence[Dict], coeffs: Dict[str, float]) -> Dict[str, float]:
    """Median and max relative error of the fitted step time over the points."""
    from vmemkv.scheduler.profile_cost import ProfileCost
    cost = ProfileCost(**coeffs)
    errs = [abs(cost.step_seconds(p["context_tokens"], p["new_tokens"], 0, p["batch"],
                                  p.get("prefill_pairs", 0), bool(p.get("cold_step", 0)),
                                  bool(p.get("after_idle", 0)))
                - p["seconds"]) / p["seconds"] for p in points]
    return {"median_rel_error": statistics.median(errs), "max_rel_error": max(errs)}


def calibrate(model_name: str = "small-llama", batches: Sequence[int] = (1, 4, 16),
              contexts: Sequence[int] = (16, 64, 256), decode_steps: int = 24, threads: int = 1,
              engine_options: Dict = None, seed: int = 0, repeats: int = 2,
              max_batch: int = 16, max_context: int = 512,
              prefill_lengths: Sequence[int] = PREFILL_LENGTHS) -> Dict:
    """The device profile (a dict, ``profile_cost``'s format) for this machine; every point
    is run ``repeats`` times (a shared machine's noise averages out in the fit). The engine is
    built with ``max_batch`` and ``max_context`` as the engine the profile stands for: a vmem
    step's attention may read the whole slot, so its cost depends on them, not only on the
    tokens cached. Besides the batch x context grid, one prompt of each of
    ``prefill_lengths`` tokens (those below ``max_context``) is prefilled alone, right after
    the previous step and again after ``IDLE_S`` of sleep: the single prompts a replay's
    arrivals make, where prefill's quadratic term and the cost of waking from idle show."""
    check_points(batches, contexts, decode_steps, max_batch, max_context)
    import torch
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import build_model
    torch.set_num_threads(threads)
    model = build_model(model_name, seed=seed)
    with Engine(model, max_batch=max_batch, max_context=max_context,
                **(engine_options or {})) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))       # warm-up
        singles = [n for n in prefill_lengths if n < max_context]
        shapes = ([(b, c, decode_steps, 0.0) for b in batches for c in contexts]
                  + [(1, n, 1, 0.0) for n in singles] + [(1, n, 1, IDLE_S) for n in singles])
        points = timed_shapes(engine, shapes, repeats, seed)
        engine_figures = {"cache": engine.config.cache, "layout": engine.config.layout,
                          "page_bytes": (engine.kv.manager.page_bytes
                                         if engine.config.cache == "vmem" else None),
                          "max_tokens_per_step": engine.config.max_tokens_per_step,
                          "max_batch": max_batch, "max_context": max_context}
    coeffs = fit(points)
    return {"format": PROFILE_FORMAT, "version": 2, "model": model_entry(model, model_name),
            "device": f"cpu: {platform.processor() or platform.machine()}, {threads} threads",
            "engine": engine_figures, "coefficients": coeffs, "points": points,
            "fit": fit_error(points, coeffs)}


def check_points(batches, contexts, decode_steps: int, max_batch: int, max_context: int) -> None:
    """EngineConfigError when a grid point does not fit the engine."""
    if max(contexts) + decode_steps > max_context or max(batches) > max_batch:
        from vmemkv.runtime.engine.errors import EngineConfigError
        raise EngineConfigError(
            f"calibration points need batch <= max_batch ({max_batch}) and context + "
            f"decode steps <= max_context ({max_context}); got batch {max(batches)}, "
            f"{max(contexts)} + {decode_steps} tokens")


def timed_shapes(engine, shapes, repeats: int, seed: int) -> List[Dict]:
    """``time_steps`` of every (batch, prompt tokens, new tokens, idle seconds before) shape,
    ``repeats`` times, random prompts (seeded)."""
    import random
    rng, vocab, points = random.Random(seed), engine.vocab_size, []
    for _ in range(repeats):
        for batch, context, new_tokens, idle_s in shapes:
            prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
            points.extend(time_steps(engine, prompts, new_tokens, idle_s))
    return points


def register(subparsers) -> None:
    from vmemkv.scheduler.cliargs import bounded, thread_count
    p = subparsers.add_parser("calibrate", help="time the engine on this machine and write a "
                                                "device profile for the simulator",
                              description="Time the real engine's steps on this machine "
                                          "(per-step cost against batch and context) and "
                                          "write a device profile JSON that vmemkv simulate "
                                          "--profile uses in place of the roofline.")
    p.add_argument("--model", default="small-llama",
                   help="built-in random-weight model to time (tiny-llama, small-llama, ...)")
    p.add_argument("--batches", type=bounded(int, 1), nargs="+", default=[1, 4, 16],
                   help="sequences per point")
    p.add_argument("--contexts", type=bounded(int, 1), nargs="+", default=[16, 64, 256],
                   help="prompt tokens per sequence per point")
    p.add_argument("--prefill-lengths", type=bounded(int, 1), nargs="*",
                   default=list(PREFILL_LENGTHS),
                   help="single prompts timed alone as well, tokens (those below --max-context)")
    p.add_argument("--decode-steps", type=bounded(int, 1), default=24,
                   help="tokens generated per sequence per point (the first decodes after a "
                        "prefill run slow: enough of them that most are not those)")
    p.add_argument("--repeats", type=bounded(int, 1), default=2, help="runs of every point")
    p.add_argument("--max-batch", type=bounded(int, 1), default=16,
                   help="the engine's max batch (as in the engine the profile stands for)")
    p.add_argument("--max-context", type=bounded(int, 2), default=512,
                   help="the engine's max context, tokens (vmem attention may read whole slots)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--out", default="profile.json", metavar="FILE",
                   help="where to write the device profile (JSON)")


def run(args) -> int:
    profile = calibrate(args.model, args.batches, args.contexts, args.decode_steps, args.threads,
                        repeats=args.repeats, max_batch=args.max_batch,
                        max_context=args.max_context, prefill_lengths=args.prefill_lengths)
    write_json(args.out, profile)       # whole or not at all
    c, e = profile["coefficients"], profile["fit"]
    print(f"vmemkv calibrate: {args.model} on {profile['device']}, {len(profile['points'])} steps")
    print(f"  step s = {c['base_s'] * 1e3:.3f} ms + {c['per_seq_s'] * 1e6:.1f} us x sequences + "
          f"{c['per_new_token_s'] * 1e6:.2f} us x new tokens "
          f"+ {c['per_context_token_s'] * 1e9:.2f} ns x context tokens "
          f"+ {c['per_prefill_pair_s'] * 1e9:.2f} ns x prefill pairs "
          f"+ {c['per_step_token_sq_s'] * 1e9:.3f} ns x new tokens^2 "
          f"+ {c['per_prefill_step_s'] * 1e3:.3f} ms x prefill step "
          f"+ {c['per_cold_step_s'] * 1e3:.3f} ms x cold step "
          f"+ {c['per_idle_wake_s'] * 1e3:.3f} ms x after idle")
    print(f"  fit error: median {e['median_rel_error']:.1%}, max {e['max_rel_error']:.1%}")
    print(f"# wrote {args.out}")
    return 0
