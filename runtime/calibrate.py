"""``vmemkv calibrate``: time the real engine's steps on this machine, fit a device profile.

For each *shape* (``batch`` prompts of ``context`` tokens generating ``decode_steps`` tokens;
single prompts of each of ``PREFILL_LENGTHS`` alone, back to back and after ``IDLE_S`` of
sleep; optionally prompts joining running batches, ``join_lengths``) every step is timed
(wall seconds around ``Engine.step``) with the plan's sequences, new and context tokens,
prefill pairs and whether it is cold or after idle (read from the scheduler's own plan: the
step's work exactly). Each of these step compositions is a *design point*. Every shape runs ``repeats`` times, in rounds (all shapes, then all again, so a burst of
load on a shared host lands on one repeat of many shapes, not on every repeat of one); then
each shape whose design points' medians are not yet known to +-``precision`` (90% of them,
distribution-free 95% intervals) runs again, up to ``max_repeats``. ``scheduler.profile_fit``
fits the coefficients of ``vmemkv.scheduler.profile_cost`` to the design points' medians (Huber
loss on relative residuals), bootstraps their 95% intervals over the repeats, and checks the host's
noise against the precision: a warning says by how much a noisy host misses it.

    vmemkv calibrate --model small-llama --precision 0.05 --repeats 6 --max-repeats 12 --out profile.json
"""
from __future__ import annotations

import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from vmemkv.scheduler.cost import AfterPrefill, prefill_pairs
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.profile_cost import (PROFILE_FORMAT, PROFILE_VERSION, profile_summary,
                                           recorded_options)
from vmemkv.scheduler.profile_cost import UNITS  # noqa: F401 (re-exported: the summary's units)
from vmemkv.scheduler.profile_design import undetermined_message
from vmemkv.scheduler.result_files import write_json

PREFILL_LENGTHS = (32, 64, 96, 128, 192, 256, 320, 384, 448)   # single prompts timed beside
                                                               # the grid, tokens
IDLE_S = 0.02       # sleep before the second run of each single prompt (after_idle)
JOIN_AFTER = 5      # steps of a batch's decoding before a joining prompt arrives (past cold)
JOIN_BATCHES = (4, 12)   # batches the join_lengths prompts join when none are given
PRECISION = 0.05    # requested half-width of each design point's median, relative
MIN_REPEATS, MAX_REPEATS = 6, 12      # repeats of every shape (6: the fewest that bound a
                                      # median, profile_fit.median_rank); the cap
RESAMPLES, MIN_RESAMPLES = 200, 10     # bootstrap refits for the coefficients' intervals


def model_entry(model, name: str) -> dict:
    """The ModelSpec fields of a torch model (what the simulator's managers size memory for),
    its sliding windows too (per layer, tokens or None: full attention)."""
    from vmemkv.runtime.hf.support import kv_shape_of, layer_windows_of
    param = next(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(name=name, dtype_bytes=param.element_size(), weight_bytes=weight_bytes,
                num_params=sum(p.numel() for p in model.parameters()), **kv_shape_of(model.config),
                layer_windows=list(layer_windows_of(model.config)))


def time_steps(engine, prompts: List[List[int]], new_tokens: int, idle_s: float = 0.0,
               joining: Optional[List[int]] = None) -> List[Dict]:
    """Every step of generating ``new_tokens`` for ``prompts``: its new and context tokens,
    prefill pairs, whether it is a cold step (from the plan the scheduler made) or the first
    after ``idle_s`` seconds of sleep (``after_idle``; 0: none), and its wall seconds.
    ``joining``: a prompt submitted after ``JOIN_AFTER`` steps, prefilled beside the running
    decodes (a mixed step, as a replay's arrivals make), generating 2 tokens."""
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
            if joining and len(points) == JOIN_AFTER:
                rids.append(engine.add_request(joining, SamplingParams(max_new_tokens=2,
                                                                       ignore_eos=True)))
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


def calibrate(model_name: str = "small-llama", batches: Sequence[int] = (1, 4, 16),
              contexts: Sequence[int] = (16, 64, 256), decode_steps: int = 24, threads: int = 1,
              engine_options: Dict = None, seed: int = 0, repeats: int = MIN_REPEATS,
              max_batch: int = 16, max_context: int = 512,
              prefill_lengths: Optional[Sequence[int]] = None, precision: Optional[float] = None,
              max_repeats: Optional[int] = None, resamples: Optional[int] = None,
              progress: Optional[Callable[[str], None]] = None,
              join_batches: Optional[Sequence[int]] = None,
              join_lengths: Sequence[int] = ()) -> Dict:
    """The device profile (a dict, ``profile_cost``'s format) for this machine. Every shape
    runs ``repeats`` times, then again while its design points' medians are not known to
    +-``precision``, at most ``max_repeats`` (default: ``max(repeats, MAX_REPEATS)``) times;
    ``progress`` gets one line per round. The engine is built with ``max_batch`` and
    ``max_context`` as the engine the profile stands for: a vmem step's attention may read the
    whole slot, so its cost depends on them, not only on the tokens cached. Besides the batch x
    context grid, one prompt of each of ``prefill_lengths`` tokens (default: those of
    ``PREFILL_LENGTHS`` below ``max_context``) is prefilled alone, right after the previous
    step and again after ``IDLE_S`` of sleep: the single prompts a replay's arrivals make,
    where prefill's quadratic term and the cost of waking from idle show. Prompts of each of
    ``join_lengths`` tokens also join running batches of each of ``join_batches`` (default
    ``JOIN_BATCHES``) sequences; ``join_batches`` without ``join_lengths`` is refused (nothing
    would join), as are ``prefill_lengths`` at or above ``max_context`` and ``precision`` and
    ``resamples`` given where nothing would use them (``check_applies``; None: ``PRECISION``,
    ``RESAMPLES``)."""
    check_counts(dict(decode_steps=decode_steps, threads=threads, repeats=repeats,
                      max_repeats=max_repeats, resamples=resamples, max_batch=max_batch,
                      max_context=max_context),
                 dict(batches=batches, contexts=contexts, prefill_lengths=prefill_lengths,
                      join_lengths=join_lengths, join_batches=join_batches))
    max_repeats = max(repeats, MAX_REPEATS) if max_repeats is None else max_repeats
    check_points(batches, contexts, decode_steps, max_batch, max_context)
    singles = single_prompts(prefill_lengths, max_context)
    check_applies(precision, resamples, max_repeats)
    precision = PRECISION if precision is None else precision
    resamples = RESAMPLES if resamples is None else resamples
    join_batches = joined_batches(join_batches, join_lengths)
    if join_lengths:
        check_joins(join_batches, join_lengths, min(contexts), decode_steps, max_batch,
                    max_context)
    check_repeats(repeats, max_repeats, precision)
    options = recorded_options(engine_options)      # the profile could not say they were used
    import torch
    from vmemkv.runtime.engine import Engine, EngineConfig, SamplingParams
    from vmemkv.runtime.models import build_model
    from vmemkv.scheduler.profile_fit import fit_profile
    torch.set_num_threads(threads)
    model = build_model(model_name, seed=seed)
    load_before = os.getloadavg()[0]
    # a step holds every batch row (--max-batch above the default 2048 was always refused,
    # naming max_tokens_per_step, which no flag sets; generate_cli does the same)
    options.setdefault("max_tokens_per_step", max(EngineConfig.max_tokens_per_step, max_batch))
    with Engine(model, max_batch=max_batch, max_context=max_context, **options) as engine:
        warm_up = [1, 2, 3][:max(1, max_context - 2)]      # 3 + 2 tokens, fewer in a short context
        engine.generate([warm_up], SamplingParams(
            max_new_tokens=min(2, max_context - len(warm_up))))
        shapes = ([(b, c, decode_steps, 0.0, 0) for b in batches for c in contexts]
                  + [(1, n, 1, 0.0, 0) for n in singles] + [(1, n, 1, IDLE_S, 0) for n in singles]
                  + [(b, min(contexts), decode_steps, 0.0, n) for b in join_batches
                     for n in join_lengths])
        points = timed_rounds(engine, shapes, repeats, max_repeats, precision, seed,
                              progress or (lambda line: None))
        engine_figures = {"cache": engine.config.cache, "layout": engine.config.layout,
                          "page_bytes": (engine.kv.manager.page_bytes
                                         if engine.kv.cache.kind is CacheKind.VMEM else None),
                          "max_tokens_per_step": engine.config.max_tokens_per_step,
                          "max_batch": max_batch, "max_context": max_context}
    fitted = fit_profile(points, precision, max_repeats, resamples, seed)
    runs = {}
    for p in points:
        runs.setdefault(p["shape"], set()).add(p["repeat"])
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "model": model_entry(model, model_name),
            "device": f"cpu: {platform.processor() or platform.machine()}, {threads} threads",
            "engine": engine_figures, "coefficients": fitted["coefficients"],
            "coefficient_intervals": fitted["coefficient_intervals"],
            "calibration": {"precision": precision, "min_repeats": repeats,
                            "max_repeats": max_repeats,
                            "repeats": [len(runs[s]) for s in sorted(runs)],
                            "shapes": [list(shape) for shape in shapes],
                            "noise": fitted["noise"],
                            "load_1min": [load_before, os.getloadavg()[0]]},
            "points": points, "fit": fitted["fit"]}


def check_points(batches, contexts, decode_steps: int, max_batch: int, max_context: int) -> None:
    """EngineConfigError when a grid point does not fit the engine."""
    if max(contexts) + decode_steps > max_context or max(batches) > max_batch:
        from vmemkv.runtime.engine.errors import EngineConfigError
        raise EngineConfigError(
            f"calibration points need batch <= max_batch ({max_batch}) and context + "
            f"decode steps <= max_context ({max_context}); got batch {max(batches)}, "
            f"{max(contexts)} + {decode_steps} tokens")


def check_counts(counts: Dict, lists: Dict) -> None:
    """EngineConfigError naming an argument outside the CLI's bounds (``calibrate`` called from
    Python timed, then failed: a batch of 0 with an IndexError, a join batch of 0 a KeyError, 0
    resamples an IndexError; a join of 0 tokens timed none): each of ``counts`` an int >= 1
    (``max_context`` 2, ``resamples`` ``MIN_RESAMPLES``), each of ``lists`` a list or tuple of
    them, batches and contexts not empty; None: the default."""
    from vmemkv.runtime.engine.errors import EngineConfigError
    for name, value in {**counts, **lists}.items():
        least = {"max_context": 2, "resamples": MIN_RESAMPLES}.get(name, 1)
        values, grid = (value if name in lists else [value]), name in ("batches", "contexts")
        if value is not None and (not isinstance(values, (list, tuple)) or (grid and not values)
                                  or any(isinstance(v, bool) or not isinstance(v, int)
                                         or v < least for v in values)):
            what = "a list of ints" if name in lists else "an int"
            raise EngineConfigError(f"calibrate {name} must be {what} >= {least}"
                                    f"{', not empty' if grid else ''}, got {value!r}")


def joined_batches(join_batches: Optional[Sequence[int]], join_lengths: Sequence[int]) -> tuple:
    """The batches prompts join: ``join_batches``, ``JOIN_BATCHES`` when None; EngineConfigError
    naming --join-batches when it is given without ``join_lengths`` (it was ignored)."""
    if join_batches is None:
        return JOIN_BATCHES
    if not join_lengths:
        from vmemkv.runtime.engine.errors import EngineConfigError
        shown = " ".join(map(str, join_batches))
        raise EngineConfigError(f"--join-batches {shown} sets the batches --join-lengths prompts "
                                f"join, and no --join-lengths is given (nothing would join): "
                                f"add --join-lengths or drop --join-batches")
    return tuple(join_batches)


def check_joins(join_batches, join_lengths, context: int, decode_steps: int, max_batch: int,
                max_context: int) -> None:
    """EngineConfigError naming the flag and its limit when a joining prompt would not join:
    its batch must leave it a slot, be decoding still after ``JOIN_AFTER`` steps, and the
    prompt must stay below ``max_context`` beside the batch's (shortest) ``context``."""
    from vmemkv.runtime.engine.errors import EngineConfigError
    if max(join_batches) > max_batch - 1:
        raise EngineConfigError(f"--join-batches {max(join_batches)} leaves the joining prompt no "
                                f"room in --max-batch {max_batch}: give --join-batches at most "
                                f"{max_batch - 1}, or a larger --max-batch")
    if decode_steps <= JOIN_AFTER:
        raise EngineConfigError(f"--join-lengths needs --decode-steps above {JOIN_AFTER} (a "
                                f"prompt joins after {JOIN_AFTER} steps of its batch); got "
                                f"--decode-steps {decode_steps}")
    if max(join_lengths) + context >= max_context:
        raise EngineConfigError(f"--join-lengths {max(join_lengths)} plus the shortest --contexts "
                                f"({context}) must stay below --max-context {max_context}: give "
                                f"--join-lengths at most {max_context - context - 1}")


def single_prompts(prefill_lengths: Optional[Sequence[int]], max_context: int) -> List[int]:
    """The single prompts' lengths, tokens: those of ``PREFILL_LENGTHS`` below ``max_context``
    when None; EngineConfigError naming --prefill-lengths when one given would not fit beside
    its one new token (it was dropped silently)."""
    if prefill_lengths is None:
        return [n for n in PREFILL_LENGTHS if n < max_context]
    if prefill_lengths and max(prefill_lengths) >= max_context:
        from vmemkv.runtime.engine.errors import EngineConfigError
        raise EngineConfigError(f"--prefill-lengths {max(prefill_lengths)} must stay below "
                                f"--max-context {max_context} (a single prompt and its one new "
                                f"token): give --prefill-lengths at most {max_context - 1}, or "
                                f"a larger --max-context")
    return list(prefill_lengths)


def check_applies(precision: Optional[float], resamples: Optional[int], max_repeats: int) -> None:
    """EngineConfigError naming --precision given with one repeat (no spread is measured, no
    median bounded: nothing is held to it), and --resamples given with fewer than
    ``MIN_REPEATS`` (no interval is drawn); None: not given."""
    from vmemkv.runtime.engine.errors import EngineConfigError
    if precision is not None and max_repeats == 1:
        raise EngineConfigError(f"--precision {precision:g} with --max-repeats 1: one repeat "
                                f"measures no spread and bounds no median, so nothing is held "
                                f"to it: give --max-repeats 2 or more ({MIN_REPEATS} bound a "
                                f"median), or drop --precision")
    if resamples is not None and max_repeats < MIN_REPEATS:
        raise EngineConfigError(f"--resamples {resamples} with --max-repeats {max_repeats}: the "
                                f"coefficients' intervals need {MIN_REPEATS} repeats of every "
                                f"shape, so none is resampled: give --max-repeats {MIN_REPEATS} "
                                f"or more, or drop --resamples")


def check_repeats(repeats: int, max_repeats: int, precision: float) -> None:
    """EngineConfigError naming the value when the repeats or the precision cannot work."""
    from vmemkv.runtime.engine.errors import EngineConfigError
    if not 1 <= repeats <= max_repeats:
        raise EngineConfigError(f"calibration repeats need 1 <= repeats <= max_repeats; got "
                                f"repeats {repeats}, max_repeats {max_repeats}")
    if not 0 < precision < 1:
        raise EngineConfigError(f"calibration precision is a relative half-width in (0, 1); "
                                f"got {precision!r}")


def timed_rounds(engine, shapes, repeats: int, max_repeats: int, precision: float, seed: int,
                 progress: Callable[[str], None]) -> List[Dict]:
    """``time_steps`` of every (batch, prompt tokens, new tokens, idle seconds before, joining
    prompt tokens) shape, each step tagged with its ``shape`` and ``repeat``: ``repeats`` rounds of every shape, then
    rounds of the shapes whose design points are not yet within ``precision``
    (``profile_fit.shape_precisions``) until none is left or each is at ``max_repeats``.
    Random prompts (seeded)."""
    import random
    from vmemkv.scheduler.profile_fit import (design_points, median_half_widths, percent,
                                               shape_precisions)
    rng, vocab, points = random.Random(seed), engine.vocab_size, []
    pending, done, rounds = list(range(len(shapes))), [0] * len(shapes), 0
    while pending:
        rounds += 1
        for s in pending:
            batch, context, new_tokens, idle_s, join = shapes[s]
            prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
            joining = [rng.randrange(vocab) for _ in range(join)] if join else None
            points.extend({**p, "shape": s, "repeat": done[s]}
                          for p in time_steps(engine, prompts, new_tokens, idle_s, joining))
            done[s] += 1
        if min(done) < repeats:          # no median is bounded yet: just the round
            progress(f"calibrate: round {rounds}: {len(pending)} shapes timed, {min(done)} of "
                     f"at least {repeats} repeats")
            continue
        dps = design_points(points)
        within = shape_precisions(dps, median_half_widths(dps.samples()))
        pending = [s for s in range(len(shapes)) if within[s] > precision and done[s] < max_repeats]
        progress(f"calibrate: round {rounds}: {sum(w <= precision for w in within.values())} "
                 f"of {len(shapes)} shapes within +-{percent(precision)}"
                 + (f", {len(pending)} again" if pending else ""))
    return points


def write_json_whole(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` whole or not at all (scheduler/result_files.py's
    ``write_json``, under the name calibrate's users import)."""
    write_json(path, obj)


def register(subparsers) -> None:
    from vmemkv.scheduler.cliargs import DistinctValues, bounded, result_file, thread_count
    p = subparsers.add_parser("calibrate", help="time the engine on this machine and write a "
                                                "device profile for the simulator",
                              description="Time the real engine's steps on this machine "
                                          "(per-step cost against batch and context), repeated "
                                          "until each design point's median is known to "
                                          "--precision, and write a device profile JSON (the "
                                          "fitted coefficients with 95% intervals) that "
                                          "vmemkv simulate --profile uses in place of the "
                                          "roofline. Warns when the host is too noisy for the "
                                          "precision, and by how much.")
    p.add_argument("--model", default="small-llama",
                   help="built-in random-weight model to time (tiny-llama, small-llama, ...)")
    p.add_argument("--batches", type=bounded(int, 1), nargs="+", default=[1, 4, 16],
                   action=DistinctValues, help="sequences per point")
    p.add_argument("--contexts", type=bounded(int, 1), nargs="+", default=[16, 64, 256],
                   action=DistinctValues, help="prompt tokens per sequence per point")
    p.add_argument("--prefill-lengths", type=bounded(int, 1), nargs="*", action=DistinctValues,
                   help=f"single prompts timed alone as well, tokens, each below --max-context "
                        f"(default: those of {' '.join(map(str, PREFILL_LENGTHS))} below it)")
    p.add_argument("--join-lengths", type=bounded(int, 1), nargs="*", default=[],
                   action=DistinctValues,
                   help=f"prompts of these lengths also join running --join-batches (mixed "
                        f"steps, as a replay's arrivals make; left out by default: held out, "
                        f"they were predicted within 4%% all the same, docs/simulation.md); "
                        f"each below --max-context minus the shortest --contexts, with "
                        f"--decode-steps above {JOIN_AFTER} (they join after {JOIN_AFTER} steps)")
    p.add_argument("--join-batches", type=bounded(int, 1), nargs="+", action=DistinctValues,
                   help=f"with --join-lengths only: sequences decoding when a --join-lengths "
                        f"prompt arrives, each below --max-batch (default: "
                        f"{' '.join(map(str, JOIN_BATCHES))})")
    p.add_argument("--decode-steps", type=bounded(int, 1), default=24,
                   help="tokens generated per sequence per point (the first decodes after a "
                        "prefill run slow: enough of them that most are not those)")
    p.add_argument("--repeats", type=bounded(int, 1), default=MIN_REPEATS,
                   help="runs of every shape at least")
    p.add_argument("--max-repeats", type=bounded(int, 1), default=None,
                   help=f"runs of a shape at most, while its design points are not within "
                        f"--precision (default: the larger of --repeats and {MAX_REPEATS})")
    p.add_argument("--precision", type=bounded(float, 0, 1, low_open=True, high_open=True),
                   default=None,
                   help=f"half-width of each design point's median's 95%% interval, relative, "
                        f"that 90%% of them must reach: the repeats past --repeats run for it "
                        f"and the noise check holds them to it (default {PRECISION}; needs "
                        f"--max-repeats 2 or more)")
    p.add_argument("--resamples", type=bounded(int, MIN_RESAMPLES), default=None,
                   help=f"bootstrap refits for the coefficients' 95%% intervals (default "
                        f"{RESAMPLES}; needs --max-repeats {MIN_REPEATS} or more)")
    p.add_argument("--max-batch", type=bounded(int, 1), default=16,
                   help="the engine's max batch (as in the engine the profile stands for)")
    p.add_argument("--max-context", type=bounded(int, 2), default=512,
                   help="the engine's max context, tokens (vmem attention may read whole slots)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--out", type=result_file, default="profile.json", metavar="FILE",
                   help="where to write the device profile (JSON; checked before the timing)")


def run(args) -> int:
    profile = calibrate(args.model, args.batches, args.contexts, args.decode_steps, args.threads,
                        repeats=args.repeats, max_batch=args.max_batch,
                        max_context=args.max_context, prefill_lengths=args.prefill_lengths,
                        precision=args.precision, max_repeats=args.max_repeats,
                        resamples=args.resamples,
                        progress=lambda line: print(line, file=sys.stderr, flush=True),
                        join_batches=args.join_batches, join_lengths=args.join_lengths)
    write_json_whole(args.out, profile)
    print(profile_summary(profile, args.model))
    noise, unsure = profile["calibration"]["noise"], profile["fit"]["undetermined"]
    for line in [noise["message"]] * noise["noisy"] + [undetermined_message(unsure)] * bool(unsure):
        print(f"vmemkv calibrate: warning: {line}", file=sys.stderr)
    print(f"# wrote {args.out}")
    return 0
