"""Hunt 32, calibration: device profiles read from what is not a file or holds an engine no
calibrate could time, the fit on data of extreme units or a stiff mix of terms, coefficients the
timed steps do not determine, a precision too fine for a float, saved calibrations' bad steps,
and the fidelity benchmarks' profile and calibrate arguments, checked before any replay."""
from __future__ import annotations

import json
import math
import os
import threading
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT, ProfileCost, load_profile
from vmemkv.scheduler.profile_design import undetermined
from vmemkv.scheduler.profile_fit import (design_points, fit_coefficients, fit_profile,
                                          repeats_for)

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000, layer_windows=[None, None])
ENGINE = dict(cache="vmem", layout="per-layer", page_bytes=65536, max_batch=4, max_context=64,
              max_tokens_per_step=2048)


def write(tmp_path, **changes) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 4, "model": MODEL,
                                "engine": ENGINE, **changes, "coefficients": {
                                    **dict.fromkeys(FITTED, 0.0), "base_s": 1e-3}}))
    return str(path)


# calibrate's shapes, smaller (as tests/scheduler/test_profile_fit.py): (batch, prompt tokens,
# generated tokens, after idle)
SHAPES = ([(b, c, 8, 0) for b in (1, 4, 16) for c in (16, 64, 256)]
          + [(1, n, 1, i) for n in (32, 96, 192, 320, 448) for i in (0, 1)])


def shape_steps(batch, context, new_tokens, idle):
    return [dict(batch=batch, new_tokens=batch * context, context_tokens=batch * context,
                 prefill_pairs=batch * context * (context - 1) // 2, cold_step=0,
                 after_idle=idle)] + [
        dict(batch=batch, new_tokens=batch, context_tokens=batch * (context + k),
             prefill_pairs=0, cold_step=int(k <= 3), after_idle=0) for k in range(1, new_tokens)]


def exact_points(coefficients, shapes=SHAPES, repeats=1):
    """Noiseless timed steps of ``shapes`` at the known ``coefficients``."""
    cost = ProfileCost(**coefficients)
    return [{**p, "shape": s, "repeat": r,
             "seconds": cost.step_seconds(p["context_tokens"], p["new_tokens"], 0, p["batch"],
                                          p["prefill_pairs"], bool(p["cold_step"]),
                                          bool(p["after_idle"]))}
            for r in range(repeats) for s, shape in enumerate(shapes)
            for p in shape_steps(*shape)]


TYPICAL = dict(base_s=1e-3, per_seq_s=1e-5, per_new_token_s=1e-5, per_context_token_s=1e-7,
               per_prefill_pair_s=1e-8, per_step_token_sq_s=1e-9, per_prefill_step_s=1e-4,
               per_cold_step_s=1e-4, per_idle_wake_s=1e-4)


def test_a_fifo_profile_is_refused_not_waited_on(tmp_path):
    fifo = str(tmp_path / "p.json")
    os.mkfifo(fifo)
    caught = []

    def load():
        with pytest.raises(ConfigError) as error:
            load_profile(fifo)
        caught.append(str(error.value))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)          # a hang guard, not a timing: the old open() waited for a writer
    if reader.is_alive():    # set the old code's reader free before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("load_profile waited on a FIFO no one writes")
    assert caught == [f"device profile {fifo}: is not a regular file (a pipe or a device): "
                      f"give a file name"]


@pytest.mark.parametrize("kind,words", [
    ("folder", "is a folder: give a file name"),   # was "[Errno 21] Is a directory: ..."
    ("device", "is not a regular file (a pipe or a device): give a file name"),  # "Expecting
], ids=["folder", "device"])                                                      # value"
def test_a_profile_that_is_not_a_regular_file_is_refused_saying_what_it_is(tmp_path, kind,
                                                                           words):
    path = str(tmp_path) if kind == "folder" else os.devnull
    with pytest.raises(ConfigError) as error:
        load_profile(path)
    assert str(error.value) == f"device profile {path}: {words}"


def test_the_cli_names_the_profile_for_its_engines_max_context(tmp_path, capsys):
    path = write(tmp_path, engine=dict(ENGINE, max_context=1))
    assert main(["simulate", "--profile", path, "--requests", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"vmemkv simulate: error: ConfigError: device profile "
                                       f"{path}: engine max_context 1 is below 2, the least "
                                       f"any engine runs\n")


@pytest.mark.parametrize("changes,words", [
    # max_context 1 loaded, then failed naming WorkloadSpec.max_total_len, not the profile
    (dict(engine=dict(ENGINE, max_context=1)), "engine max_context 1 is below 2, the least any "
                                               "engine runs"),
    # loaded, and simulate warned of a --max-tokens-per-step the user never gave
    (dict(engine=dict(ENGINE, max_tokens_per_step=2)), "engine max_tokens_per_step 2 is below "
                                                       "its max_batch 4: a step holds every "
                                                       "running sequence"),
    # was "cannot convert dictionary update sequence element #0 to a sequence"
    (dict(model=[1, 2]), "bad model entry: model must be an object, got [1, 2]"),
    # loaded, and reported as the model 5
    (dict(model=dict(MODEL, name=5)), "bad model entry: model name must be a non-empty string, "
                                      "got 5"),
    # loaded as version 4
    (dict(version=4.0), "version 4.0 is not one this vmemkv reads (1, 2, 3, 4): rerun vmemkv "
                        "calibrate, or use the vmemkv that wrote it"),
], ids=["max_context_1", "tokens_per_step_below_batch", "model_list", "model_name_int",
        "version_float"])
def test_a_profile_entry_no_calibrate_writes_is_refused_by_name(tmp_path, changes, words):
    path = write(tmp_path, **changes)
    with pytest.raises(ConfigError) as error:
        load_profile(path)
    assert str(error.value) == f"device profile {path}: {words}"


@pytest.mark.parametrize("unit", [1e-300, 1e-12, 1e12, 1e300],
                         ids=["1e-300", "1e-12", "1e12", "1e300"])
def test_the_fit_does_not_depend_on_the_unit_of_the_seconds(unit):
    # steps of 1e-300 s were a numpy LinAlgError ("SVD did not converge"); of 1e300 s the fit
    # was all 0 with a relative error of 100%
    points = exact_points(TYPICAL)
    scaled = [{**p, "seconds": p["seconds"] * unit} for p in points]
    want = fit_coefficients(design_points(points))
    got = fit_coefficients(design_points(scaled))
    for name in FITTED:
        assert got[name] == pytest.approx(want[name] * unit, rel=1e-9, abs=1e-9 * unit * 1e-9)


def test_a_term_worth_little_of_every_step_is_recovered_not_left_at_0():
    # per_new_token_s worth 1e-4 of its steps beside large prefill terms: the active-set test
    # compared gradients of unscaled columns, stopped with it at 0 (and per_seq_s 1.6e-3 in
    # its place), 1e-4 off at a design point, on exact data
    truth = dict(zip(FITTED, (0.0, 0.0, 1e-8, 0.0, 5.712490384081692e-06,
                              1.9136754361645889e-07, 1e-4, 1e-4, 0.05712490384081692)))
    dps = design_points(exact_points(truth))
    got = fit_coefficients(dps)
    predicted = dps.rows @ np.array([got[k] for k in FITTED])
    assert abs(predicted / dps.medians() - 1).max() < 1e-9
    assert got["per_new_token_s"] == pytest.approx(1e-8, rel=1e-6)
    assert got["per_seq_s"] < 1e-15


# Noiseless data on a design that determines every coefficient has a zero-residual
# non-negative solution, the truth; the fit must find it. Tolerance 1e-9 relative at every
# design point: the fit stops when no coefficient moves by 1e-7 of itself in an iteration,
# from the first one's non-negative least squares on columns of unit norm, which is exact to
# round-off times the design's condition (~1e2 here, ~1e-13); found at most 2e-14 in 2,000
# examples (before the columns were scaled, 1e-4).
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1e3)), min_size=len(FITTED),
                max_size=len(FITTED)).filter(lambda m: m[0] or m[1] or m[2]))
@example([0.0, 0.0, 1e-3, 0.0, 571.2490384081692, 191.36754361645887, 1.0, 1.0,
          571.2490384081692])    # hypothesis found it: 1e-4 off before the columns were scaled
def test_noiseless_data_gives_the_known_coefficients_back(multiples):
    truth = {k: TYPICAL[k] * m for k, m in zip(FITTED, multiples)}
    dps = design_points(exact_points(truth))
    got = fit_coefficients(dps)
    assert all(v >= 0 for v in got.values())
    predicted = dps.rows @ np.array([got[k] for k in FITTED])
    assert abs(predicted / dps.medians() - 1).max() < 1e-9


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.floats(1e-6, 1.0), min_size=len(SHAPES), max_size=len(SHAPES)),
       st.integers(0, 2**32 - 1))
def test_any_positive_step_times_fit_coefficients_of_at_least_0(shape_seconds, seed):
    rng = np.random.default_rng(seed)
    points = [{**p, "shape": s, "seconds": shape_seconds[s] * rng.lognormal(0, 1)}
              for s, shape in enumerate(SHAPES) for p in shape_steps(*shape)]
    got = fit_coefficients(design_points(points))
    assert all(math.isfinite(v) and v >= 0 for v in got.values())


def test_coefficients_the_timed_steps_do_not_determine_are_named_and_have_no_interval():
    # one batch: sequences always 1, as the base term's 1 and a decode's one new token; whole
    # prompts' pairs L(L - 1)/2 a mix of new tokens and their square; no single prompt after
    # idle: nothing measures the wake. The fit gave them a split and zero-width intervals that
    # looked measured
    shapes = [(1, c, 8, 0) for c in (16, 64, 256)] + [(1, 96, 1, 0)]
    profile = fit_profile(exact_points(TYPICAL, shapes, repeats=6), precision=0.05,
                          max_repeats=6, resamples=10)
    unsure = ["base_s", "per_seq_s", "per_new_token_s", "per_prefill_pair_s",
              "per_step_token_sq_s", "per_idle_wake_s"]
    assert profile["fit"]["undetermined"] == unsure
    intervals = profile["coefficient_intervals"]
    assert [k for k in FITTED if intervals[k] is None] == unsure
    assert intervals["per_context_token_s"] == pytest.approx([1e-7, 1e-7], rel=1e-9)  # exact
    # calibrate's own grid determines every one
    assert fit_profile(exact_points(TYPICAL), 0.05, 12)["fit"]["undetermined"] == []


def test_undetermined_is_what_the_rows_span_leaves_free():
    # 1, b and b^2 over three batches tell base_s and the square apart; sequences, new tokens
    # and context tokens move together; four terms are never there
    rows = np.array([[1, b, b, 8 * b, 0, b * b, 0, 0, 0] for b in (1, 2, 4)], dtype=float)
    assert undetermined(rows) == [k for k in FITTED if k not in ("base_s", "per_step_token_sq_s")]
    assert undetermined(np.eye(len(FITTED))) == []


def test_a_precision_too_fine_for_a_float_gives_its_repeats_not_an_overflow():
    # --precision 1e-200 timed every round, then died in an OverflowError traceback
    spread = 0.1
    assert repeats_for(spread, 1e-200) == math.ceil(
        (Fraction(1.96 * 1.2533 * spread) / Fraction(1e-200)) ** 2)
    points = exact_points(TYPICAL, SHAPES[:2], repeats=6)
    for k, p in enumerate(points):
        p["seconds"] *= 1 + 0.1 * ((k * 7) % 5 - 2)
    noise = fit_profile(points, precision=1e-200, max_repeats=6, resamples=10)["noise"]
    assert noise["needed_repeats"] == repeats_for(noise["spread_p90"], 1e-200) > 10**390
    assert f"+-1e-198% on 90% of the design points' medians needs about 5.28e+399 repeats; " \
           f"running with the cap of 6" in noise["message"]


def test_calibrate_warns_of_what_its_timed_steps_do_not_determine(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["calibrate", "--model", "tiny-llama", "--batches", "1", "--contexts", "8",
                 "--decode-steps", "2", "--repeats", "1", "--max-repeats", "1",
                 "--prefill-lengths", "--max-batch", "1", "--max-context", "16",
                 "--out", out]) == 0
    unsure = json.loads(open(out).read())["fit"]["undetermined"]
    assert "per_seq_s" in unsure and "per_idle_wake_s" in unsure
    assert capsys.readouterr().err.splitlines()[-1] == (f"vmemkv calibrate: warning: the timed steps do not determine "
                       f"{', '.join(unsure)}: no design point tells them apart from the other "
                       f"terms, so their fitted values are arbitrary (their intervals null) and "
                       f"a simulation whose steps differ from those timed charges them "
                       f"unmeasured; time more --batches, --contexts and --prefill-lengths (the "
                       f"defaults determine every coefficient)")


STEP = dict(batch=1, new_tokens=1, context_tokens=9, prefill_pairs=0, cold_step=0,
            after_idle=0, shape=0, repeat=0, seconds=1e-3)


@pytest.mark.parametrize("points,words", [
    (5, "points must be a list of timed steps, got 5"),               # a TypeError traceback
    ([dict(STEP, batch="4")], "points[0].batch must be an int >= 1, got '4'"),  # read as 4
    ([dict(STEP, cold_step=5)], "points[0].cold_step must be 0 or 1, got 5"),   # 5 cold steps
    ([{k: v for k, v in STEP.items() if k != "batch"}],                 # KeyError: 'batch'
     "points[0] must be a timed step, an object with batch, new_tokens, context_tokens and "
     "seconds, got {'new_tokens': 1, 'context_tokens': 9, 'prefill_pairs': 0, 'cold_step': 0, "
     "'after_idle': 0, 'shape': 0, 'repeat': 0, 'seconds': 0.001}"),
], ids=["not_a_list", "string_batch", "cold_step_5", "no_batch"])
def test_a_saved_calibrations_bad_step_is_refused_naming_the_file(tmp_path, capsys, points,
                                                                  words):
    from vmemkv.benchmarks.calibration_stability import main as stability
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "points": points,
                                "calibration": {"load_1min": [0.0, 0.0]}}))
    with pytest.raises(SystemExit) as exit_:
        stability(["--from", str(path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: --from {path}: {words}")


@pytest.mark.parametrize("options,named", [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),            # timed int8, profile silent
    ({"cache": "paged", "block_size": 4}, "block_size"),       # simulate ran --block-size 16
    ({"max_batch": 2}, "max_batch"),                           # a TypeError after the build
], ids=["kv_cache_dtype", "block_size", "max_batch"])
def test_calibrate_refuses_engine_options_its_profile_cannot_record(monkeypatch, options, named):
    from vmemkv.runtime import calibrate as calibrate_module
    from vmemkv.runtime import models
    monkeypatch.setattr(models, "build_model", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ConfigError) as error:
        calibrate_module.calibrate("tiny-llama", batches=(1,), contexts=(8,), decode_steps=2,
                                   repeats=1, max_repeats=1, max_batch=2, max_context=32,
                                   prefill_lengths=(), engine_options=options)
    assert str(error.value) == (
        f"calibrate engine_options {named}: the options a device profile records are cache, "
        f"layout, page_bytes, max_tokens_per_step (max_batch and max_context are calibrate's "
        f"own arguments); a simulation of a profile timed with another runs its default: "
        f"leave it out")


def small_llama_profile(tmp_path, name="small-llama") -> str:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({
        "format": PROFILE_FORMAT, "version": 1, "coefficients": dict(
            base_s=1e-3, per_seq_s=0, per_new_token_s=0, per_context_token_s=0),
        "model": dict(name=name, num_layers=4, num_kv_heads=2, head_dim=32, dtype_bytes=4,
                      weight_bytes=6291456)}))
    return str(path)


@pytest.mark.parametrize("case,words", [
    # each ran the first replay (minutes), then failed, or ran on a profile of another model
    ("missing", "--profile: device profile {path}: [Errno 2] No such file or directory: "
                "'{path}'"),
    ("tiny-llama", "--profile {path} timed tiny-llama, and this benchmark replays small-llama: "
                   "give a profile of small-llama (vmemkv calibrate --model small-llama)"),
    ("with_calibrate_args", "--calibrate-args --max-repeats 16 sets the calibrations this run "
                            "would make, and --profile {path} is used instead: drop one"),
], ids=["missing", "other_model", "with_calibrate_args"])
def test_fidelity_checks_its_profile_before_any_replay(tmp_path, capsys, case, words):
    from vmemkv.benchmarks import fidelity
    path = str(tmp_path / "cal.json") if case == "missing" else small_llama_profile(
        tmp_path, "tiny-llama" if case == "tiny-llama" else "small-llama")
    argv = ["--profile", path] + (["--calibrate-args", "--max-repeats 16"]
                                  if case == "with_calibrate_args" else [])
    with pytest.raises(SystemExit) as exit_:
        fidelity.parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {words.format(path=path)}\n")


@pytest.mark.parametrize("extra,flag", [
    ("--model tiny-llama", "--model"), ("--max-b 4", "--max-batch"),     # an abbreviation too
    ("--repeats 6 --max-context=64", "--max-context"), ("--out x.json", "--out"),
], ids=["model", "max_batch_abbreviated", "max_context", "out"])
def test_fidelity_refuses_calibrate_args_that_set_what_it_sets(capsys, extra, flag):
    # the profile was of another model or engine than the one replayed, or written elsewhere
    # (the run failed after its first replay, on the missing file)
    from vmemkv.benchmarks import fidelity
    with pytest.raises(SystemExit) as exit_:
        fidelity.parse_args(["--calibrate-args", extra])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: --calibrate-args {extra}: {flag} is set by this benchmark (the engine it "
        f"replays, the profile it reads); drop it"
        + (", and give --max-context or --threads here\n" if flag == "--max-context" else "\n"))


def test_a_failed_calibration_ends_the_round_before_its_replay(tmp_path, capsys, monkeypatch):
    from vmemkv import cli
    from vmemkv.benchmarks import fidelity
    args = fidelity.parse_args(["--calibrate-args", "--max-repeats 1 --precision 0.1"])
    with pytest.raises(ConfigError) as error:     # its status was ignored: the replay ran
        fidelity.calibrated(args, str(tmp_path), 0)
    path = tmp_path / "profile-0.json"
    assert str(error.value) == (
        f"vmemkv calibrate --model small-llama --threads 1 --out {path} --max-batch 16 "
        f"--max-context 512 --max-repeats 1 --precision 0.1 failed (exit 2; its error is "
        f"above): fix --calibrate-args")
    assert "--precision 0.1 with --max-repeats 1" in capsys.readouterr().err
    monkeypatch.setattr(cli, "main", lambda argv: 130)      # Ctrl-C in calibrate: the run's too
    with pytest.raises(KeyboardInterrupt, match="round 1 not calibrated"):
        fidelity.calibrated(args, str(tmp_path), 0)


class _Engine:
    """Steps whose plans run 1, 1 (then nothing left), 1 (a new arrival)."""
    def __init__(self):
        plan = SimpleNamespace(num_new_tokens=1, num_context_tokens=1, seqs=[])
        self.scheduler, self.left = SimpleNamespace(schedule=lambda: plan), [2, 1, 0, 1, 0]

    def step(self):
        self.scheduler.schedule(), self.left.pop(0)

    def has_unfinished(self):
        return bool(self.left[0])


def test_the_traced_replay_marks_and_charges_the_steps_after_idle():
    # the simulator charges per_idle_wake_s on the first step and on one after nothing ran;
    # the trace's step errors did not, and read the wake as the profile's error (-50% here)
    from vmemkv.benchmarks.fidelity import _StepClock
    from vmemkv.benchmarks.fidelity_trace import step_errors
    steps, engine = [], _Engine()
    clock = _StepClock(engine, steps, perf_counter=lambda: 1.0)
    clock.align(0.0, 0.0)
    for _ in range(3):
        clock.step(engine)
    assert [s["after_idle"] for s in steps] == [True, False, True]
    cost = ProfileCost(base_s=1e-3, per_seq_s=0, per_new_token_s=0, per_context_token_s=0,
                       per_idle_wake_s=1e-3)
    timed = [{**s, "seconds": 2e-3 if s["after_idle"] else 1e-3, "prefill_pairs": 0,
              "num_seqs": 1, "seqs": [(1, 1, True)]} for s in steps]
    assert step_errors(timed, cost)["warm_decode_median_rel_error"] == 0.0


def test_fidelity_trace_checks_its_profile_before_the_replay(tmp_path, capsys, monkeypatch):
    from vmemkv.benchmarks import fidelity_trace
    monkeypatch.setattr(fidelity_trace, "run_engine", lambda *a: pytest.fail("replayed"))
    path = small_llama_profile(tmp_path, "tiny-llama")
    with pytest.raises(SystemExit) as exit_:
        fidelity_trace.main(["--profile", path, "--requests", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: --profile {path} timed tiny-llama, and this benchmark replays small-llama: "
        f"give a profile of small-llama (vmemkv calibrate --model small-llama)\n")
