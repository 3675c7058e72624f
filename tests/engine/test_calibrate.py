"""`vmemkv calibrate` on a toy model and a handful of points (figures mean nothing here), and its
repeats policy on made-up step times (no wall clock)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vmemkv.cli import main
from vmemkv.runtime import calibrate as calibrate_module
from vmemkv.scheduler.profile_cost import FITTED, load_profile
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", "tiny-llama", "--batches", "1", "2", "--contexts", "8",
                 "16", "--decode-steps", "2", "--repeats", "1", "--max-repeats", "1",
                 "--prefill-lengths", "12", "40", "--max-context", "64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "# wrote" in printed.out and "95% interval" in printed.out
    # one repeat cannot bound a median: the calibration says so, on stderr
    assert "warning:" in printed.err and "spread is not measured" in printed.err
    profile = load_profile(str(out))
    assert profile["version"] == 4 and profile["calibration"]["repeats"] == [1] * 8
    assert profile["calibration"]["noise"]["noisy"]
    # nor can one repeat be resampled: no interval (it was a zero-width one missing its estimate)
    assert profile["coefficient_intervals"] == dict.fromkeys(FITTED)
    assert printed.out.count("n/a (fewer than 6 repeats)") == len(FITTED)
    # each value with its unit, interval or not ('base_s 4.39' read as seconds: it was ms)
    rows = {line.split()[0]: line.split()[2] for line in printed.out.splitlines()
            if line.strip().split(" ")[0] in FITTED}
    assert rows == {name: calibrate_module.UNITS[name][0] for name in FITTED}
    assert profile["model"]["num_layers"] == 2 and profile["model"]["dtype_bytes"] == 4
    assert profile["model"]["layer_windows"] == [None, None]
    # each point: one prefill step and (decode_steps - 1) decodes, at least
    assert len(profile["points"]) >= 4 * 2
    assert all(p["seconds"] > 0 and p["new_tokens"] >= p["batch"] for p in profile["points"])
    # a prefill point of 16-token prompts carries their 16 * 15 / 2 pairs each
    assert {p["prefill_pairs"] for p in profile["points"] if p["new_tokens"] == 16 * p["batch"]} \
        == {120, 240}
    # the single prompts below --max-context (64) were prefilled alone, right after the
    # previous step and after a sleep (the only points after idle)
    singles = sorted(p["new_tokens"] for p in profile["points"]
                     if p["batch"] == 1 and p["new_tokens"] not in (1, 8, 16))
    assert singles == [12, 12, 40, 40]
    assert sorted(p["new_tokens"] for p in profile["points"] if p["after_idle"]) == [12, 40]
    assert {p["repeat"] for p in profile["points"]} == {0}
    # --decode-steps 2: one decode after each prefill, so every decode is a cold step
    assert all(p["cold_step"] == (p["new_tokens"] == p["batch"]) for p in profile["points"])
    entries = generate(WorkloadSpec(num_requests=10, max_total_len=64, seed=2))
    r = simulate(entries, SimConfig(policy="vmem", profile=str(out), page_bytes=4096,
                                    cache_bytes=2 * 10**6, max_seq_len=64))
    assert r.output_tokens == sum(e.output_len for e in entries)
    assert json.loads(out.read_text())["format"] == "vmemkv-device-profile"


def test_calibration_points_outside_the_engine_are_refused():
    from vmemkv.runtime.calibrate import calibrate
    from vmemkv.runtime.engine.errors import EngineConfigError
    with pytest.raises(EngineConfigError, match="max_context"):
        calibrate("tiny-llama", batches=(1,), contexts=(600,), decode_steps=8, max_context=512)


def test_repeats_stop_where_the_medians_are_bounded_and_go_on_to_the_cap_where_not(monkeypatch):
    # made-up step times: every shape exact, except batch-2 shapes, 30% noise
    rng = np.random.default_rng(0)

    def fake_time_steps(engine, prompts, new_tokens, idle_s=0.0, joining=None):
        batch, context = len(prompts), len(prompts[0])
        noise = rng.lognormal(0, 0.3) if batch == 2 else 1.0
        return [dict(batch=batch, new_tokens=batch * context if k == 0 else batch,
                     context_tokens=batch * (context + k), prefill_pairs=0, cold_step=0,
                     after_idle=int(bool(idle_s) and k == 0),
                     seconds=1e-3 * (batch + context + k) * noise) for k in range(new_tokens)]

    monkeypatch.setattr(calibrate_module, "time_steps", fake_time_steps)
    engine = type("FakeEngine", (), {"vocab_size": 50})()
    shapes = [(1, 8, 3, 0.0, 0), (2, 8, 3, 0.0, 0), (1, 16, 1, 0.0, 0), (1, 16, 1, 0.02, 0)]
    lines = []
    points = calibrate_module.timed_rounds(engine, shapes, repeats=6, max_repeats=9,
                                           precision=0.05, seed=0, progress=lines.append)
    runs = {s: len({p["repeat"] for p in points if p["shape"] == s}) for s in range(4)}
    assert runs == {0: 6, 1: 9, 2: 6, 3: 6}
    # one line a round: 5 before any median is bounded, then 4 of the precision reached
    assert len(lines) == 9 and "round 1: 4 shapes timed, 1 of at least 6 repeats" in lines[0]
    assert "3 of 4 shapes within" in lines[5] and "1 again" in lines[5]


def test_calibration_repeats_and_precision_out_of_range_are_refused():
    from vmemkv.runtime.calibrate import calibrate
    from vmemkv.runtime.engine.errors import EngineConfigError
    with pytest.raises(EngineConfigError, match="max_repeats"):
        calibrate("tiny-llama", repeats=8, max_repeats=4)
    with pytest.raises(EngineConfigError, match="precision"):
        calibrate("tiny-llama", precision=0.0)


@pytest.mark.parametrize("value", ["0", "1", "nan"])
def test_the_cli_refuses_a_precision_outside_0_1_before_timing(value, capsys):
    # 1 passed the flag's check, then calibrate() refused it after loading the model
    from vmemkv.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--precision", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --precision" in err


def test_a_result_file_is_written_whole_or_not_at_all(tmp_path):
    from vmemkv.runtime.calibrate import write_json_whole
    path = tmp_path / "out.json"
    write_json_whole(str(path), {"a": 1})
    with pytest.raises(TypeError):
        write_json_whole(str(path), {"a": 2, "b": {1, 2}})        # fails half-way through
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("name", ["tiny-mistral-swa", "tiny-gemma3"])
def test_the_profile_records_a_sliding_window_models_windows(name):
    from vmemkv.runtime.hf.support import layer_windows_of
    from vmemkv.runtime.models import build_model
    from vmemkv.scheduler.profile_cost import profile_model
    model = build_model(name)
    entry = calibrate_module.model_entry(model, name)
    assert entry["layer_windows"] == list(layer_windows_of(model.config))
    assert any(w is not None for w in entry["layer_windows"])
    spec = profile_model({"version": 4, "model": json.loads(json.dumps(entry))})
    assert spec.layer_windows == layer_windows_of(model.config)   # what the engine attends with


def test_every_round_says_how_far_it_got(monkeypatch):
    monkeypatch.setattr(calibrate_module, "time_steps",
                        lambda engine, prompts, new_tokens, idle_s=0.0, joining=None: [dict(
                            batch=1, new_tokens=1, context_tokens=1, prefill_pairs=0,
                            cold_step=0, after_idle=0, seconds=1e-3)])
    lines = []
    calibrate_module.timed_rounds(type("E", (), {"vocab_size": 9})(), [(1, 4, 1, 0.0, 0)] * 2,
                                  repeats=3, max_repeats=3, precision=0.05, seed=0,
                                  progress=lines.append)
    assert [line.split(":")[1] for line in lines] == [" round 1", " round 2", " round 3"]


@pytest.mark.parametrize("out,words", [(".", "is a folder"),
                                       ("/proc/p.json", "cannot write a file in /proc")])
def test_an_out_that_cannot_be_written_is_refused_before_anything_is_timed(
        monkeypatch, capsys, out, words):
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: pytest.fail("timed"))
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--model", "tiny-llama", "--out", out])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --out" in err and words in err


JOIN = ["calibrate", "--model", "tiny-llama", "--batches", "2", "--contexts", "16",
        "--repeats", "1", "--max-repeats", "1", "--prefill-lengths", "--max-context", "64",
        "--max-batch", "4"]


@pytest.mark.parametrize("flags,words", [
    # nothing joined: the batch had finished before a prompt could join
    (["--decode-steps", "5", "--join-lengths", "8", "--join-batches", "2"],
     "--join-lengths needs --decode-steps above 5 (a prompt joins after 5 steps of its batch); "
     "got --decode-steps 5"),
    # the join shape was dropped silently
    (["--decode-steps", "6", "--join-lengths", "8", "48", "--join-batches", "2"],
     "--join-lengths 48 plus the shortest --contexts (16) must stay below --max-context 64: "
     "give --join-lengths at most 47"),
    # named max_batch (3), a value the user never gave
    (["--decode-steps", "6", "--join-lengths", "8", "--join-batches", "4"],
     "--join-batches 4 leaves the joining prompt no room in --max-batch 4: give --join-batches "
     "at most 3"),
    # nothing joined: the batches were ignored without --join-lengths
    (["--decode-steps", "6", "--join-batches", "2", "3"],
     "--join-batches 2 3 sets the batches --join-lengths prompts join, and no --join-lengths is "
     "given (nothing would join): add --join-lengths or drop --join-batches"),
])
def test_joins_that_would_not_join_are_refused_naming_the_flags(monkeypatch, tmp_path, capsys,
                                                                flags, words):
    monkeypatch.setattr(calibrate_module, "timed_rounds", lambda *a: pytest.fail("timed"))
    assert main(JOIN + flags + ["--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_the_join_limits_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "each below --max-context minus the shortest --contexts" in text
    assert "--decode-steps above 5" in text and "each below --max-batch" in text


def test_a_context_of_a_few_tokens_calibrates(tmp_path):
    # --max-context 4 passed every check, then the 3-token warm-up + 2 tokens was refused
    profile = calibrate_module.calibrate("tiny-llama", batches=(1,), contexts=(1,),
                                         decode_steps=1, repeats=1, max_repeats=1, max_batch=1,
                                         max_context=4, prefill_lengths=())
    assert profile["engine"]["max_context"] == 4 and profile["points"]


@pytest.mark.parametrize("max_batch,step_tokens", [(16, 2048), (3000, 3000)])
def test_a_max_batch_past_the_default_step_budget_raises_the_budget(monkeypatch, max_batch,
                                                                   step_tokens):
    # --max-batch above 2048 was always refused, naming max_tokens_per_step (no flag sets it)
    import vmemkv.runtime.engine as engine_package
    built = {}

    class Built(Exception):
        pass

    def engine(model, **options):
        built.update(options)
        raise Built
    monkeypatch.setattr(engine_package, "Engine", engine)
    with pytest.raises(Built):
        calibrate_module.calibrate("tiny-llama", batches=[1], contexts=[8], decode_steps=1,
                                   max_batch=max_batch, max_context=64, prefill_lengths=())
    assert built["max_tokens_per_step"] == step_tokens and built["max_batch"] == max_batch


@pytest.mark.parametrize("flags,words", [
    # --prefill-lengths 64 was dropped silently ("those below --max-context")
    (["--prefill-lengths", "12", "64"],
     "--prefill-lengths 64 must stay below --max-context 64 (a single prompt and its one new "
     "token): give --prefill-lengths at most 63, or a larger --max-context"),
    # one repeat: no spread measured, no median bounded, nothing held to the precision
    (["--precision", "0.02"],
     "--precision 0.02 with --max-repeats 1: one repeat measures no spread and bounds no "
     "median, so nothing is held to it: give --max-repeats 2 or more (6 bound a median), or "
     "drop --precision"),
    # fewer than 6 repeats: no interval is drawn, the refits were never made
    (["--repeats", "5", "--max-repeats", "5", "--resamples", "50"],
     "--resamples 50 with --max-repeats 5: the coefficients' intervals need 6 repeats of every "
     "shape, so none is resampled: give --max-repeats 6 or more, or drop --resamples"),
])
def test_a_flag_that_would_do_nothing_is_refused_by_name(monkeypatch, tmp_path, capsys, flags,
                                                         words):
    monkeypatch.setattr(calibrate_module, "timed_rounds", lambda *a: pytest.fail("timed"))
    args = JOIN[:JOIN.index("--prefill-lengths")] + ["--max-context", "64", "--decode-steps", "2"]
    assert main(args + flags + ["--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "p.json").exists()


def test_the_default_prefill_lengths_are_those_below_max_context_and_given_ones_all_run():
    assert calibrate_module.single_prompts(None, 64) == [32]
    assert calibrate_module.single_prompts(None, 512) == list(calibrate_module.PREFILL_LENGTHS)
    assert calibrate_module.single_prompts([12, 63], 64) == [12, 63]
    assert calibrate_module.single_prompts([], 64) == []


def test_with_fixed_repeats_precision_is_what_the_noise_check_holds_the_medians_to(monkeypatch):
    # --max-repeats equal to --repeats runs no more repeats, yet --precision still sets the
    # noise check's verdict (so it is not refused): the same 10%-noisy steps reach +-50%, not 1%
    rng = np.random.default_rng(0)
    monkeypatch.setattr(calibrate_module, "time_steps",
                        lambda engine, prompts, new_tokens, idle_s=0.0, joining=None: [dict(
                            batch=len(prompts), new_tokens=len(prompts[0]), context_tokens=0,
                            prefill_pairs=0, cold_step=0, after_idle=0,
                            seconds=1e-3 * len(prompts) * rng.lognormal(0, 0.1))])
    noise = {precision: calibrate_module.calibrate(
        "tiny-llama", batches=(1, 2), contexts=(8,), decode_steps=1, repeats=6, max_repeats=6,
        max_batch=2, max_context=16, prefill_lengths=(), precision=precision,
        resamples=10)["calibration"]["noise"] for precision in (0.5, 0.01)}
    assert not noise[0.5]["noisy"] and noise[0.5]["precision"] == 0.5
    assert noise[0.01]["noisy"] and "+-1.0%" in noise[0.01]["message"]
