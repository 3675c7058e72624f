"""benchmarks/fidelity.py --repeats: the statistics over rounds (exact numbers on made-up
errors) and the rounds' orchestration with the engine and the calibration faked (no wall clock,
no model)."""
from __future__ import annotations

import json

import pytest

from vmemkv.benchmarks import fidelity
from vmemkv.benchmarks.fidelity_stats import engine_floor_errors, error_summary, summarize


def test_error_summary_is_median_min_max_and_the_p90_of_the_absolute_error():
    s = error_summary([0.1, -0.2, 0.05, 0.0, 0.3])
    # |errors| sorted 0, .05, .1, .2, .3: the 90th percentile is 60% from .2 to .3
    assert s == pytest.approx({"median": 0.05, "min": -0.2, "max": 0.3, "p90_abs": 0.26, "n": 5})
    assert error_summary([]) is None


def test_the_engine_floor_takes_every_replay_as_the_prediction_of_every_other():
    assert engine_floor_errors([100.0, 110.0]) == pytest.approx([0.1, -10 / 110])
    assert len(engine_floor_errors([1.0, 2.0, 3.0, 4.0, 5.0])) == 20
    assert engine_floor_errors([7.0]) == []


def comparison(rate, measured, simulated, lag_ms=0.5, load=(0.5, 0.6)):
    return {"rate_scale": rate, "measured": {"output_throughput": measured},
            "simulated": {"output_throughput": simulated},
            "rel_error": {"output_throughput": (simulated - measured) / measured},
            "submit_lag_ms": {"median": lag_ms / 2, "max": lag_ms}, "load_1min": list(load)}


def test_summary_per_rate_judges_the_p90_of_the_absolute_error_against_the_goal():
    rounds = [{"comparisons": [comparison(1.0, 100.0, 101.0), comparison(4.0, 100.0, 130.0)]},
              {"comparisons": [comparison(1.0, 100.0, 99.0, lag_ms=3.0),
                               comparison(4.0, 110.0, 120.0, load=(1.5, 2.0))]}]
    s = summarize(rounds, ["output_throughput"], {"output_throughput": 0.10})
    assert set(s) == {"1", "4"} and s["1"]["rounds"] == 2
    one, four = s["1"]["output_throughput"], s["4"]["output_throughput"]
    assert one["within_goal"] and not four["within_goal"]
    assert one["error"]["min"] == pytest.approx(-0.01) and one["error"]["max"] == pytest.approx(0.01)
    assert four["engine"] == pytest.approx({"median": 105.0, "min": 100.0, "max": 110.0})
    assert four["engine_floor"]["p90_abs"] == pytest.approx(0.1 - 0.1 * (0.1 - 1 / 11))
    assert s["1"]["submit_lag_max_ms"] == 3.0 and s["4"]["load_1min"] == [0.5, 2.0]


def test_repeats_run_whole_rounds_and_write_the_json_whole_after_each(tmp_path, monkeypatch,
                                                                      capsys):
    calibrations, written = [], []
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"coefficients": {"base_s": 1e-3}}))

    def fake_calibrated(args, folder, index):
        calibrations.append(index)
        return str(profile)

    def fake_measure(args, profile_path):
        m = 100.0 + len(calibrations)          # each round's engine a little slower
        return {"rate_scale": args.rate_scale, "measured": dict.fromkeys(fidelity.FIGURES, m),
                "simulated": dict.fromkeys(fidelity.FIGURES, m * 1.02),
                "rel_error": dict.fromkeys(fidelity.FIGURES, 0.02),
                "within_goal": dict.fromkeys(fidelity.FIGURES, True),
                "submit_lag_ms": {"median": 0.1, "max": 0.2}, "load_1min": [0.5, 0.6]}

    real_write = fidelity.write_json_whole

    def recording_write(path, obj):
        written.append(obj["rounds_done"])
        real_write(path, obj)

    monkeypatch.setattr(fidelity, "calibrated", fake_calibrated)
    monkeypatch.setattr(fidelity, "measure", fake_measure)
    monkeypatch.setattr(fidelity, "write_json_whole", recording_write)
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--repeats", "3", "--rate-scales", "1", "4", "--json", str(out)]) == 0
    assert calibrations == [0, 1, 2] and written == [1, 2, 3]
    result = json.loads(out.read_text())
    assert [len(r["comparisons"]) for r in result["rounds"]] == [2, 2, 2]
    ttft = result["summary"]["4"]["median_ttft_ms"]
    assert ttft["error"]["p90_abs"] == pytest.approx(0.02)
    assert ttft["engine"] == {"median": 102.0, "min": 101.0, "max": 103.0}
    printed = capsys.readouterr()
    assert "round 3/3" in printed.err and "s left" in printed.err
    assert "p90|err|" in printed.out
    assert list(tmp_path.glob(".tmp-*")) == []


def test_the_old_single_rate_flag_still_works():
    assert fidelity.parse_args(["--rate-scale", "4", "1"]).rate_scales == [4.0, 1.0]
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--repeats", "0"])


def test_on_exact_steps_every_fit_simulates_the_same_replay(tmp_path):
    from vmemkv.benchmarks.calibration_stability import FITS
    from vmemkv.benchmarks.fidelity_stats import fit_lines
    from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT, ProfileCost
    from vmemkv.scheduler.simulator import SimConfig, simulate
    from vmemkv.scheduler.workload import WorkloadSpec, generate
    cost = ProfileCost(base_s=1e-3, per_seq_s=2e-5, per_new_token_s=5e-5,
                       per_context_token_s=3e-7, per_prefill_pair_s=5e-8)
    points = [dict(batch=b, new_tokens=n, context_tokens=c, prefill_pairs=q, cold_step=0,
                   after_idle=0, shape=i, repeat=r,
                   seconds=cost.step_seconds(c, n, 0, b, q))
              for r in range(2) for i, (b, n, c, q) in enumerate(
                  [(1, 1, 10, 0), (4, 4, 400, 0), (16, 16, 4000, 0), (8, 8, 900, 0),
                   (1, 64, 64, 2016), (1, 256, 256, 32640), (4, 256, 256, 8064),
                   (2, 100, 300, 9950), (1, 16, 16, 120), (1, 32, 32, 496)])]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 3, "points": points,
                                "model": dict(name="toy", num_layers=2, num_kv_heads=2,
                                              head_dim=32, dtype_bytes=4, weight_bytes=10**6),
                                "coefficients": {k: getattr(cost, k) for k in FITTED}}))
    entries = generate(WorkloadSpec(num_requests=12, max_total_len=64, seed=3))
    config = SimConfig(policy="vmem", profile=str(path), page_bytes=4096, cache_bytes=2 * 10**6,
                       max_seq_len=64)
    own = simulate(entries, config).report()
    measured = {k: own[k] * 1.1 for k in fidelity.FIGURES}
    fits = fidelity.other_fits(entries, config, measured)
    assert list(fits) == list(FITS)
    for name, fit in fits.items():
        for k in fidelity.FIGURES:
            assert fit["simulated"][k] == pytest.approx(own[k], rel=1e-6), (name, k)
            assert fit["rel_error"][k] == pytest.approx(1 / 1.1 - 1, rel=1e-5)
    lines = fit_lines([{"comparisons": [{"rate_scale": 2.0, "fits": fits}]}], fidelity.FIGURES)
    assert len(lines) == 1 + len(FITS) and "-9.1%" in lines[1]


def test_the_noise_table_says_n_a_for_intervals_too_few_repeats_cannot_give():
    # fit_profile gives no interval below 6 repeats (a zero-width one missed its estimate);
    # the stability table read it as a pair: a TypeError
    from tests.scheduler.test_profile_fit import synthetic
    from vmemkv.benchmarks.calibration_stability import noise_lines
    few, many = synthetic(repeats=2, noise=0.02, seed=1), synthetic(repeats=6, noise=0.02, seed=1)
    header, short, full = noise_lines([few, many], [(0.1, 0.2), (0.1, 0.2)], precision=0.05)
    assert "interval width" in header
    assert short.split()[-2] == "n/a" and full.split()[-2].endswith("%")
