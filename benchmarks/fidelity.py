"""Simulator fidelity: one trace through the real engine and through the simulator with a
device profile calibrated on this machine; the simulator's prediction error, over repeated
rounds beside the engine's own run-to-run spread.

    .venv/bin/python benchmarks/fidelity.py [--repeats 5] [--rate-scales 1 4 8] [--trace azure-conv]
        [--requests 64] [--length-scale 0.25] [--profile profile.json] [--json out.json]

The trace's first ``--requests`` requests, lengths times ``--length-scale`` and fitted to the
engine's ``--max-context`` (the small model's scale), are replayed with their arrival times
(times ``1 / --rate-scale``) on ``small-llama`` (vmem cache, 1 thread): a request is submitted
when the wall clock passes its arrival (between steps), the engine steps while anything is
unfinished, and latencies count from the arrival, as the simulator's do. The
simulator runs the same entries with the profile (``vmemkv calibrate``; made first when no
``--profile`` is given), the engine's cache size, page size, batch and token limits. Both
reports come from ``scheduler/report.py``; the error is (simulated - measured) / measured.

``--repeats N``: N independent rounds, each a fresh calibration (unless ``--profile``) and one
comparison per rate scale; every figure's error is then reported as its median, min-max and
p90 of |error| over the rounds, beside the engine floor (the N engine replays of each rate
predicting each other, ``fidelity_stats``). Progress goes to stderr; ``--json`` is rewritten
whole after every round (a temporary file, then ``os.replace``). ``--compare-fits`` also writes
one profile per fit beside the calibration's (``--profile sub/cal.json``: ``sub/cal.fit0.json``,
``sub/cal.fit1.json``, ...), replacing earlier ones of those names; with ``--profile`` they are
checked before anything runs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Dict, List, Optional

from vmemkv.benchmarks.fidelity_stats import fit_lines, summarize, table_lines
from vmemkv.benchmarks.common import exit_status, flags_given
from vmemkv.cli import INTERRUPTED_EXIT, TERMINATED_EXIT, OneLineArgumentParser
from vmemkv.runtime.calibrate import write_json_whole
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import load_profile, profile_model
from vmemkv.scheduler.report import serving_report
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.traces import fit_to_length, load_trace
from vmemkv.scheduler.cliargs import (POSITIVE_FLOAT, POSITIVE_INT, DistinctValues, file_problem,
                                      result_file, thread_count)

FIGURES = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms")
GOALS = {"output_throughput": 0.10, "median_ttft_ms": 0.15, "p90_ttft_ms": 0.15,
         "median_tpot_ms": 0.15}
MODEL, MAX_BATCH, SEED = "small-llama", 16, 0
SPIN_S = 0.001      # an idle replay spins, not sleeps, this close to the next arrival


def workload(args) -> list:
    """The trace's first requests at the small model's scale."""
    entries = load_trace(args.trace, rate_scale=args.rate_scale, max_requests=args.requests)
    scaled = [replace(e, prompt_len=max(1, round(e.prompt_len * args.length_scale)),
                      output_len=max(1, round(e.output_len * args.length_scale)), hash_ids=())
              for e in entries]
    return fit_to_length(scaled, args.max_context)[0]


def replay_engine(engine, entries, vocab: int, steps: Optional[List[Dict]] = None,
                  perf_counter=time.perf_counter, sleep=time.sleep) -> tuple:
    """Submit each entry when the clock (``perf_counter``) passes its arrival; step until all
    finish. Returns (timings, lags): the requests' RequestTimings with arrival = the entry's
    arrival on the engine clock, and each submission's lag behind its arrival (seconds). The
    loop submits only between steps, so a request arriving mid-step is submitted when the step
    ends; any server makes it wait for that step, and its TTFT counts the wait (measured from
    the submission it would not: the benchmark's error, up to a whole prefill step).
    ``steps``: also record every step there (fidelity_trace). Prompts are drawn before the
    clock starts, and an idle loop sleeps to ``SPIN_S`` before the next arrival and spins the
    rest (an oversleep would be the benchmark's lag, not the engine's)."""
    from vmemkv.runtime.engine import SamplingParams
    from vmemkv.runtime.engine.outputs import request_timings
    rng, rids, lags, i = random.Random(SEED), [], [], 0
    prompts = [[rng.randrange(vocab) for _ in range(e.prompt_len)] for e in entries]
    clock, t0 = _StepClock(engine, steps, perf_counter), perf_counter()
    while i < len(entries) or engine.has_unfinished():
        now = perf_counter() - t0
        while i < len(entries) and entries[i].arrival_s <= now:
            submitted_s = perf_counter() - t0
            lags.append(submitted_s - entries[i].arrival_s)
            rids.append(engine.add_request(prompts[i], SamplingParams(
                max_new_tokens=entries[i].output_len, ignore_eos=True)))
            clock.align(engine.output(rids[-1]).arrival_s - submitted_s, t0)
            i += 1
        if engine.has_unfinished():
            clock.step(engine)
        elif i < len(entries) and entries[i].arrival_s - now > SPIN_S:
            sleep(min(entries[i].arrival_s - now - SPIN_S, 0.05))
    clock.close(engine)
    outputs = [engine.output(rid, pop=True) for rid in rids]
    unfinished = [out for out in outputs if out.status != "finished"]
    if unfinished:   # a request without a token has no timing: the lags below would shift
        first = unfinished[0]
        raise RuntimeError(f"{len(unfinished)} of {len(outputs)} requests did not finish "
                           f"(request {first.request_id}: {first.status}, {first.error}); the "
                           f"engine's timings cannot be compared with the simulator's")
    timings = request_timings(outputs)
    return [replace(t, arrival_s=t.arrival_s - lag) for t, lag in zip(timings, lags)], lags


class _StepClock:
    """Steps the engine; with a ``steps`` list, records each plan (fidelity_trace.tap_plans)
    and the step's end and seconds, on the engine clock (from the first request's arrival), and
    whether it came ``after_idle`` (the first step, or one after the engine had nothing to run:
    the simulator's rule, which charges it ``per_idle_wake_s``; the trace's step errors left
    it out and read an idle step's wake as the profile's error)."""

    def __init__(self, engine, steps: Optional[List[Dict]], perf_counter):
        self.steps, self.offset_s, self.perf_counter = steps, None, perf_counter
        self.idle = True
        if steps is not None:
            from vmemkv.benchmarks.fidelity_trace import tap_plans
            tap_plans(engine.scheduler, steps, self.now)

    def now(self) -> float:
        return self.perf_counter() - self.t0 + self.offset_s

    def align(self, offset_s: float, t0: float) -> None:
        """Engine clock = replay clock (perf_counter - t0) + ``offset_s``; the first call
        sets it."""
        if self.offset_s is None:
            self.offset_s, self.t0 = offset_s, t0

    def step(self, engine) -> None:
        engine.step()
        if self.steps is None:
            return
        end, after_idle, self.idle = self.now(), self.idle, not engine.has_unfinished()
        self.steps[-1].update(end_s=end, seconds=end - self.steps[-1]["start_s"],
                              after_idle=after_idle)

    def close(self, engine) -> None:
        if self.steps is not None:
            from vmemkv.benchmarks.fidelity_trace import untap
            untap(engine.scheduler)


def sim_config(engine, profile_path: str) -> SimConfig:
    """The simulator deployment of ``engine`` (vmem, its cache, pages, batch and token limits)
    with the device profile at ``profile_path``."""
    mgr, cfg = engine.kv.manager, engine.config
    return SimConfig(policy="vmem", profile=profile_path, max_seq_len=cfg.max_context,
                     cache_bytes=mgr.stats().total_tokens * mgr.bytes_per_token,
                     page_bytes=mgr.page_bytes, layout=cfg.layout,
                     scheduler=SchedulerConfig(max_running=cfg.max_batch,
                                               max_tokens_per_step=cfg.max_tokens_per_step,
                                               watermark=cfg.watermark))


def measure(args, profile_path: str) -> dict:
    import torch
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import build_model
    torch.set_num_threads(args.threads)
    entries = workload(args)
    model = build_model(MODEL, seed=SEED)
    load_before = os.getloadavg()[0]
    with Engine(model, max_batch=MAX_BATCH, max_context=args.max_context) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))      # warm-up
        timings, lags = replay_engine(engine, entries, model.config.vocab_size)
        measured = serving_report(timings)
        config = sim_config(engine, profile_path)
    simulated = simulate(entries, config).report()
    errors = {k: (simulated[k] - measured[k]) / measured[k] for k in FIGURES}
    fits = other_fits(entries, config, measured) if getattr(args, "compare_fits", False) else {}
    return {"requests": len(entries), "trace": args.trace, "rate_scale": args.rate_scale,
            "length_scale": args.length_scale, "measured": {k: measured[k] for k in FIGURES},
            "simulated": {k: simulated[k] for k in FIGURES}, "rel_error": errors,
            "within_goal": {k: abs(errors[k]) <= GOALS[k] for k in FIGURES},
            "submit_lag_ms": {"median": statistics.median(lags) * 1e3, "max": max(lags) * 1e3},
            "engine_ttft_from_submission_ms": from_submission(timings, lags),
            "load_1min": (load_before, os.getloadavg()[0]), **({"fits": fits} if fits else {})}


def other_fits(entries, config: SimConfig, measured: Dict) -> Dict[str, Dict]:
    """The same replay simulated with each fit of ``calibration_stability.FITS`` made on the
    same calibration's steps (``--compare-fits``): which fit predicts the engine best, on
    identical data. Each variant profile is written beside the calibration's (``fit_paths``)."""
    from vmemkv.benchmarks.calibration_stability import FITS
    with open(config.profile, encoding="utf-8") as f:
        profile = json.load(f)
    out = {}
    for path, (name, fit) in zip(fit_paths(config.profile), FITS.items()):
        write_json_whole(path, {**profile, "coefficients": fit(profile["points"])})
        simulated = simulate(entries, replace(config, profile=path)).report()
        out[name] = {"simulated": {k: simulated[k] for k in FIGURES},
                     "rel_error": {k: (simulated[k] - measured[k]) / measured[k]
                                   for k in FIGURES}}
    return out


def fit_paths(profile_path: str) -> List[str]:
    """The variant profiles ``--compare-fits`` writes, one per fit: in the profile's folder,
    its name less its extension then ``.fitN.json`` (``sub/cal.json`` -> ``sub/cal.fit0.json``;
    ``sub/cal`` -> ``sub/cal.fit0.json``: ``[:-5]`` made it ``su.fit0.json``, in another folder,
    over a user's file)."""
    from vmemkv.benchmarks.calibration_stability import FITS
    stem = os.path.splitext(profile_path)[0]
    return [f"{stem}.fit{i}.json" for i in range(len(FITS))]


def from_submission(timings, lags) -> dict:
    """The engine's TTFT p50/p90 (ms) measured from submission instead of arrival: what the
    benchmark reported before it measured from the arrival (the difference is its own lag)."""
    report = serving_report([replace(t, arrival_s=t.arrival_s + lag)
                             for t, lag in zip(timings, lags)])
    return {k: report[k] for k in ("median_ttft_ms", "p90_ttft_ms")}


def parse_args(argv=None):
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--requests", type=POSITIVE_INT, default=64)
    ap.add_argument("--rate-scales", "--rate-scale", dest="rate_scales", type=POSITIVE_FLOAT, nargs="+",
                    default=[1.0], action=DistinctValues,
                    help="one comparison per value, in turn, each round")
    ap.add_argument("--repeats", type=POSITIVE_INT, default=1,
                    help="independent calibrate-and-replay rounds")
    ap.add_argument("--length-scale", type=POSITIVE_FLOAT, default=0.25)
    ap.add_argument("--max-context", type=POSITIVE_INT, default=512)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--profile", default=None,
                    help="one device profile for every round (default: calibrate each round)")
    ap.add_argument("--calibrate-args", default="",
                    help="extra calibrate flags, e.g. '--max-repeats 16'")
    ap.add_argument("--compare-fits", action="store_true",
                    help="also simulate each replay with the other fits of the same "
                         "calibration (benchmarks/calibration_stability.py's)")
    ap.add_argument("--refit", metavar="FILE",
                    help="no run: --compare-fits again on an earlier --json (its profiles)")
    ap.add_argument("--json", metavar="FILE", type=result_file, help="also write the result here (whole)")
    args = ap.parse_args(argv)
    ignored = flags_given(ap, args, [dest for dest in vars(args)    # --refit compares fits
                                     if dest not in ("refit", "compare_fits")])
    if args.refit and ignored:     # each was dropped in silence (--json wrote nothing)
        ap.error(f"{ignored[0]} would be ignored: --refit runs nothing and writes nothing, it "
                 f"re-simulates the earlier run with the flags that run recorded; drop it")
    for path in fit_paths(args.profile) if args.compare_fits and args.profile else []:
        problem = file_problem(path)     # before the replays: they were lost after them
        if problem:
            ap.error(f"--compare-fits writes each fit's profile beside --profile: {problem}")
    if args.profile and args.calibrate_args:     # it was ignored
        ap.error(f"--calibrate-args {args.calibrate_args} sets the calibrations this run would "
                 f"make, and --profile {args.profile} is used instead: drop one")
    problem = profile_problem(args.profile) if args.profile else check_calibrate_args(args)
    if problem:      # before anything is replayed: each failed after the first, minutes in
        ap.error(problem)
    return args


def profile_problem(path: str) -> Optional[str]:
    """Why the device profile at ``path`` cannot stand for the replay's engine, or None: it
    does not load, or it timed another model than ``MODEL`` (whose shape then sized the
    simulator's memory, silently). fidelity_trace checks its ``--profile`` the same way."""
    try:
        model = profile_model(load_profile(path), path).name
    except ConfigError as error:
        return f"--profile: {error}"
    if model != MODEL:
        return (f"--profile {path} timed {model}, and this benchmark replays {MODEL}: give a "
                f"profile of {MODEL} (vmemkv calibrate --model {MODEL})")
    return None


def calibrate_argv(args, path: str) -> List[str]:
    """The ``vmemkv calibrate`` command line of a round: the replay's model and engine, the
    profile written to ``path``, then ``--calibrate-args``."""
    return ["calibrate", "--model", MODEL, "--threads", str(args.threads), "--out", path,
            "--max-batch", str(MAX_BATCH), "--max-context", str(args.max_context),
            *args.calibrate_args.split()]


def check_calibrate_args(args) -> Optional[str]:
    """``--calibrate-args`` parsed as calibrate would (a bad flag ended the run after its first
    replay: calibrate's exit status was ignored); what is wrong with one that sets what the
    benchmark sets (``--model``, ``--out``, ``--max-batch``, ``--max-context``, ``--threads``:
    the profile was of another engine than the one replayed, or not where the run read it)."""
    from vmemkv.cli import build_parser
    path = os.path.join(tempfile.gettempdir(), "vmemkv-fidelity-check.json")
    parsed = vars(build_parser().parse_args(calibrate_argv(args, path)))
    own = dict(model=MODEL, threads=args.threads, out=path, max_batch=MAX_BATCH,
               max_context=args.max_context)
    dest = next((d for d, value in own.items() if parsed[d] != value), None)
    return dest and (f"--calibrate-args {args.calibrate_args}: --{dest.replace('_', '-')} is "
                     f"set by this benchmark (the engine it replays, the profile it reads); "
                     f"drop it" + (", and give --max-context or --threads here"
                                   if dest in ("max_context", "threads") else ""))


def calibrated(args, folder: str, index: int) -> str:
    """A fresh device profile for round ``index`` (``vmemkv calibrate``), its path;
    ConfigError when calibrate fails (the replay ran on, then failed on the missing file)."""
    from vmemkv.cli import main as vmemkv
    path = os.path.join(folder, f"profile-{index}.json")
    status = vmemkv(calibrate_argv(args, path))
    if status in (INTERRUPTED_EXIT, TERMINATED_EXIT):    # Ctrl-C or SIGTERM: this run's too
        raise KeyboardInterrupt(f"round {index + 1} not calibrated")
    if status:
        raise ConfigError(f"vmemkv calibrate {' '.join(calibrate_argv(args, path)[1:])} "
                          f"failed (exit {status}; its error is above): fix --calibrate-args")
    return path


def profile_record(path: str) -> Dict:
    """What a round's result keeps of its profile: coefficients, intervals, fit, noise."""
    with open(path, encoding="utf-8") as f:
        profile = json.load(f)
    cal = profile.get("calibration", {})
    return {"path": path, "coefficients": profile["coefficients"],
            "coefficient_intervals": profile.get("coefficient_intervals"),
            "fit": profile.get("fit"), "noise": cal.get("noise"), "load_1min": cal.get("load_1min")}


def print_comparison(out: Dict) -> None:
    print(f"--rate-scale {out['rate_scale']:g}: 1-minute load {out['load_1min'][0]:.2f} before, "
          f"{out['load_1min'][1]:.2f} after; submission lag median "
          f"{out['submit_lag_ms']['median']:.2f} ms, max {out['submit_lag_ms']['max']:.2f} ms")
    print(f"{'figure':<20}{'engine':>12}{'simulator':>12}{'error':>9}{'goal':>7}")
    for k in FIGURES:
        print(f"{k:<20}{out['measured'][k]:>12.2f}{out['simulated'][k]:>12.2f}"
              f"{out['rel_error'][k]:>+9.1%}{GOALS[k]:>6.0%}"
              f"{'' if out['within_goal'][k] else ' !'}")
    print(json.dumps(out))


def progress(line: str) -> None:
    print(f"fidelity: {line}", file=sys.stderr, flush=True)


def refit(path: str) -> int:
    """``--refit FILE``: the fit comparison of an earlier ``--json`` again with today's fits
    (``calibration_stability.FITS``), each replay re-simulated against the engine's figures
    as measured then; the rounds' profiles must still be where that run wrote them."""
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.models import build_model
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if not isinstance(saved, dict) or "argv" not in saved or "rounds" not in saved:
        raise ConfigError(f"--refit {path}: not this benchmark's --json (no argv and "
                          f"rounds)")
    args = parse_args(saved["argv"])
    with Engine(build_model(MODEL, seed=SEED), max_batch=MAX_BATCH,
                max_context=args.max_context) as engine:
        base = sim_config(engine, saved["rounds"][0]["profile"]["path"])
    for r in saved["rounds"]:
        for c in r["comparisons"]:
            entries = workload(argparse.Namespace(**{**vars(args), "rate_scale": c["rate_scale"]}))
            c["fits"] = other_fits(entries, replace(base, profile=r["profile"]["path"]),
                                   c["measured"])
    print("\n".join(fit_lines(saved["rounds"], FIGURES)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.refit:
        return refit(args.refit)
    folder = tempfile.mkdtemp(prefix="vmemkv-fidelity-")
    rounds: List[Dict] = []
    started = time.perf_counter()
    for index in range(args.repeats):
        elapsed = time.perf_counter() - started
        eta = f", about {elapsed / index * (args.repeats - index):.0f} s left" if index else ""
        progress(f"round {index + 1}/{args.repeats} ({elapsed:.0f} s so far{eta}): "
                 + ("calibrating" if args.profile is None else "replaying"))
        profile = args.profile or calibrated(args, folder, index)
        comparisons = []
        for rate in args.rate_scales:
            progress(f"round {index + 1}/{args.repeats}: rate scale {rate:g}")
            out = measure(argparse.Namespace(**{**vars(args), "rate_scale": rate}), profile)
            print_comparison(out)
            comparisons.append(out)
        rounds.append({"round": index, "profile": profile_record(profile),
                       "comparisons": comparisons})
        summary = summarize(rounds, FIGURES, GOALS)
        if args.json:
            write_json_whole(args.json, {"argv": sys.argv[1:] if argv is None else list(argv),
                                         "repeats": args.repeats, "rounds_done": len(rounds),
                                         "goals": GOALS, "summary": summary, "rounds": rounds})
    print(f"\n{args.repeats} round(s), {time.perf_counter() - started:.0f} s; error = (simulated "
          f"- measured) / measured; floor: the engine's replays predicting each other")
    print("\n".join(table_lines(summary, FIGURES, GOALS)))
    if args.compare_fits:
        print("\nthe same replays simulated with each fit of the same calibrations:")
        print("\n".join(fit_lines(rounds, FIGURES)))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status("fidelity", main))
