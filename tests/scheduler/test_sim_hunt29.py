"""Simulator hunt 29 (no torch): ``--seeds`` over runs some of which have no TPOT (every
request of one output token: NaN) averages the figure over the runs that have it, as it does a
steady-state mean a run lacks (it crashed, AttributeError in statistics.pstdev, after every
run); an SLO naming one figure twice is refused (the later target silently replaced the
earlier); find-max-rate says how many trace requests it scaled down (it never said); a sweep
refuses a trace point simulate refuses before any point runs (it ran the others); the table
shows a TTFT under 10 ms to three digits (a small model's 0.09 ms read 0)."""
import json
import math

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.capacity import parse_slo
from vmemkv.scheduler.cli_table import aggregate, format_table
from vmemkv.scheduler.errors import ConfigError

# one request each; seed 1 draws two output tokens, the others one (no TPOT, no ITL)
ONE_TOKEN_SEEDS = ["simulate", "--requests", "1", "--output-mean", "1.5", "--output-p95", "4",
                   "--seeds", "0-5", "--no-progress"]


def test_a_figure_nan_in_some_runs_is_over_the_runs_that_have_it():
    stats = aggregate([{"tpot": math.nan, "a": 1.0}, {"tpot": 4.0, "a": 3.0},
                       {"tpot": 6.0, "a": 5.0}])
    assert stats["mean"] == {"tpot": 5.0, "a": 3.0}
    assert stats["std"] == pytest.approx({"tpot": 1.0, "a": math.sqrt(8 / 3)})
    assert stats["counts"] == {"tpot": 2}


def test_a_figure_nan_in_every_run_is_nan_over_none():
    stats = aggregate([{"tpot": math.nan, "a": 1.0}, {"tpot": math.nan, "a": 3.0}])
    assert math.isnan(stats["mean"]["tpot"]) and math.isnan(stats["std"]["tpot"])
    assert stats["counts"] == {"tpot": 0}


def test_seeds_whose_runs_lack_tpot_report_the_runs_that_have_it(capsys):
    assert main(ONE_TOKEN_SEEDS + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    have = [r["median_tpot_ms"] for r in d["runs"] if r["median_tpot_ms"] is not None]
    assert [r["total_output_tokens"] for r in d["runs"]] == [1, 2, 1, 1, 1, 1]
    assert len(have) == 1 and d["mean"]["median_tpot_ms"] == have[0] > 0
    assert d["std"]["median_tpot_ms"] == 0.0
    assert d["counts"]["median_tpot_ms"] == 1 and d["counts"]["p99_itl_ms"] == 1
    assert "output_tokens_per_s" not in d["counts"]


def test_the_table_says_over_how_many_seeds_tpot_is():
    runs = [{"median_tpot_ms": math.nan, "p99_tpot_ms": math.nan, "num_requests": 1},
            {"median_tpot_ms": 4.0, "p99_tpot_ms": 5.0, "num_requests": 1}]
    stats = aggregate(runs)
    summary = dict(stats["mean"], policy="paged",
                   config={"model_preset": "llama-3-8b", "gpu": "h100", "cache_gb": 60.0})
    text = format_table(summary, stats["std"], [0, 1], stats["counts"])
    assert "4.00 ± 0.00 / 5.00 ± 0.00" in text
    assert "TPOT median / p99 over the 1 of 2 seeds whose runs have it" in text


@pytest.mark.parametrize("text", ["ttft_p90=2000,ttft_p90=5", "ttft_p90=2000,ttft_p90.0=5",
                                  "tpot_mean=100, tpot_mean=100"])
def test_an_slo_naming_one_figure_twice_is_refused_naming_both(text):
    first, second = (item.strip() for item in text.split(","))
    with pytest.raises(ConfigError, match="again") as refused:
        parse_slo(text)
    assert repr(first) in str(refused.value) and repr(second) in str(refused.value)


def test_find_max_rate_refuses_a_target_given_twice_before_any_probe(capsys):
    argv = ["simulate", "--find-max-rate", "--slo", "ttft_p90=2000,ttft_p90=5",
            "--requests", "20", "--no-progress"]
    with pytest.raises(SystemExit) as usage_error:      # argparse: the flag's usage error
        main(argv)
    assert usage_error.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "--slo" in err and "p90_ttft_ms" in err


def test_find_max_rate_on_a_trace_says_once_how_many_requests_it_scaled_down(tmp_path, capsys):
    trace = tmp_path / "long.jsonl"      # the second request is longer than --max-len 4096
    trace.write_text('{"prompt_len": 100, "output_len": 4, "arrival_s": 0.0}\n'
                     '{"prompt_len": 5000, "output_len": 4, "arrival_s": 0.5}\n')
    argv = ["simulate", "--find-max-rate", "--slo", "ttft_p90=60000", "--trace", str(trace),
            "--max-probes", "3", "--no-progress", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["probes"]) == 3
    note = "1 of 2 trace requests were longer than --max-len 4096 tokens and were scaled down"
    assert err.count(note) == 1


TWO_REQUESTS = ('{"prompt_len": 10, "output_len": 3, "arrival_s": 0.0}\n'
                '{"prompt_len": 20, "output_len": 1, "arrival_s": 1.5}\n')


@pytest.mark.parametrize("trace_text, grid, refusal", [
    (TWO_REQUESTS, '"rate_scale": [0.5, 1e-300]',
     "point rate_scale = 1e-300: trace {trace} at rate_scale 1e-300: an arrival at 1.5e+300 s"),
    (TWO_REQUESTS.replace(', "arrival_s": 1.5', ""), '"policy": ["paged", "vmem"]',
     "{trace} line 2: no arrival_s")], ids=["rate_scale past the clock", "a line without arrival"])
def test_a_sweep_whose_trace_simulate_refuses_at_one_point_runs_none(tmp_path, capsys,
                                                                     trace_text, grid, refusal):
    trace, out = tmp_path / "t.jsonl", tmp_path / "out"
    trace.write_text(trace_text)
    spec = tmp_path / "spec.json"
    spec.write_text(f'{{"base": {{"trace": "{trace}"}}, "grid": {{{grid}}}}}')
    assert main(["sweep", str(spec), "--out", str(out), "--jobs", "1", "--no-plots"]) == 2
    assert refusal.format(trace=trace) in capsys.readouterr().err
    assert not out.exists()          # nothing ran, nothing written (a row per point ran before)


def test_the_table_shows_a_small_models_sub_millisecond_ttft(capsys):
    argv = ["simulate", "--model-preset", "tiny", "--requests", "20", "--cache-gb", "1",
            "--no-progress"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert 0 < d["median_ttft_ms"] < 0.5 and 0 < d["p99_ttft_ms"] < 0.5
    assert main(argv) == 0
    table = capsys.readouterr().out
    ttft = next(line for line in table.splitlines() if "TTFT median / p99 (ms)" in line)
    assert ttft.split()[-3:] == [f"{d['median_ttft_ms']:.3g}", "/", f"{d['p99_ttft_ms']:.3g}"]
    e2el = next(line for line in table.splitlines() if "E2EL median / p99 (ms)" in line)
    assert d["p99_e2el_ms"] >= 10 and e2el.split()[-1] == f"{d['p99_e2el_ms']:,.0f}"   # whole


def test_table_milliseconds_are_whole_from_10_and_three_digits_below():
    shown = []
    for median_ms, p99_ms in ((0.0912, 4.7946), (9.9996, 10.4), (100.0, 2171.3)):
        run = {"median_ttft_ms": median_ms, "p99_ttft_ms": p99_ms, "policy": "paged",
               "num_requests": 1, "config": {"model_preset": "tiny", "gpu": "h100",
                                             "cache_gb": 1.0}}
        ttft = next(line for line in format_table(run).splitlines() if "TTFT" in line)
        shown.append(" ".join(ttft.split()[-3:]))
    assert shown == ["0.0912 / 4.79", "10 / 10", "100 / 2,171"]
