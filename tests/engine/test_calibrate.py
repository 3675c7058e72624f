"""`vmemkv calibrate` on a toy model and a handful of points (figures mean nothing here)."""
from __future__ import annotations

import json

import pytest

from vmemkv.cli import main
from vmemkv.runtime.calibrate import fit
from vmemkv.scheduler.profile_cost import load_profile
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate


def test_fit_recovers_the_coefficients_of_exact_data():
    truth = dict(base_s=0.002, per_seq_s=3e-5, per_new_token_s=2e-4, per_context_token_s=1e-6)
    points = [dict(batch=b, new_tokens=n, context_tokens=c,
                   seconds=truth["base_s"] + truth["per_seq_s"] * b + truth["per_new_token_s"] * n
                   + truth["per_context_token_s"] * c)
              for b, n, c in [(1, 1, 10), (4, 4, 400), (16, 16, 4000), (1, 64, 64), (4, 256, 256),
                              (8, 8, 900), (2, 100, 300)]]
    got = fit(points)
    for key, value in truth.items():
        assert got[key] == pytest.approx(value, rel=1e-3), key


def test_fit_recovers_the_prefill_and_cold_coefficients_of_exact_data():
    truth = dict(base_s=0.001, per_seq_s=2e-5, per_new_token_s=7e-5, per_context_token_s=5e-7,
                 per_prefill_pair_s=7e-8, per_step_token_sq_s=5e-9, per_prefill_step_s=5e-4,
                 per_cold_step_s=4e-4, per_idle_wake_s=3e-4)
    shapes = [(1, 1, 10, 0, 0, 0), (4, 4, 400, 0, 0, 0), (16, 16, 4000, 0, 0, 0),
              (8, 8, 900, 0, 0, 0), (1, 1, 20, 0, 1, 0), (4, 4, 300, 0, 1, 0),
              (1, 64, 64, 2016, 0, 0), (1, 256, 256, 32640, 0, 0), (4, 256, 256, 8064, 0, 0),
              (2, 100, 300, 9950, 0, 0), (16, 1024, 1024, 32256, 0, 0), (1, 16, 16, 120, 0, 0),
              (1, 64, 64, 2016, 0, 1), (1, 16, 16, 120, 0, 1)]
    points = [dict(batch=b, new_tokens=n, context_tokens=c, prefill_pairs=q, cold_step=w,
                   after_idle=i, seconds=sum(truth[k] * x for k, x in zip(
                       truth, (1, b, n, c, q, n * n, q > 0, w, i))))
              for b, n, c, q, w, i in shapes]
    got = fit(points)
    for key, value in truth.items():
        assert got[key] == pytest.approx(value, rel=1e-3), key


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", "tiny-llama", "--batches", "1", "2", "--contexts", "8",
                 "16", "--decode-steps", "2", "--repeats", "1", "--prefill-lengths", "12", "40",
                 "100", "--max-context", "64", "--out", str(out)]) == 0
    assert "# wrote" in capsys.readouterr().out
    profile = load_profile(str(out))
    assert profile["model"]["num_layers"] == 2 and profile["model"]["dtype_bytes"] == 4
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
