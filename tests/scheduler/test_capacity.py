"""Capacity search: SLO parsing, the bracket-and-bisect search, and the CLI."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.capacity import find_max_load, parse_slo, percentiles_of, report_key
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import SimConfig
from vmemkv.scheduler.workload import WorkloadSpec, generate

CONFIG = SimConfig(cache_bytes=2 * 10**9)
SLO = {"ttft_p90": 500.0}


def poisson(rate: float):
    return generate(WorkloadSpec(num_requests=150, arrival_rate=rate, seed=1))


def test_slo_text_parses_to_milliseconds_per_target():
    assert parse_slo("ttft_p90=2000,tpot_p99=200") == {"ttft_p90": 2000.0, "tpot_p99": 200.0}
    assert report_key("ttft_p90") == "p90_ttft_ms" and report_key("e2el_median") == "median_e2el_ms"
    assert percentiles_of({"itl_p99.9": 5.0}) == (50.0, 90.0, 99.0, 99.9)


@pytest.mark.parametrize("text", ["ttft=2000", "ttft_p90:2000", "latency_p90=1", "ttft_p90=-1",
                                  "ttft_p101=5", ""])
def test_bad_slo_is_a_config_error_naming_the_item(text):
    with pytest.raises(ConfigError, match="SLO"):
        parse_slo(text)


def test_search_brackets_the_capacity_within_the_tolerance():
    result = find_max_load(poisson, CONFIG, SLO, start=2.0, rel_tol=0.05)
    assert result.bounded and result.best.meets
    failing = [p.load for p in result.probes if not p.meets]
    assert min(failing) / result.max_load <= 1.05
    assert all(p.meets for p in result.probes if p.load <= result.max_load)


def short_requests(rate: float):
    """20 requests of at most 64 tokens: enough where no SLO is met at any load."""
    return generate(WorkloadSpec(num_requests=20, max_total_len=64, arrival_rate=rate, seed=1))


def test_search_reports_no_load_when_even_the_lowest_probe_fails():
    result = find_max_load(short_requests, CONFIG, {"ttft_p90": 1e-6}, start=1.0, max_probes=4)
    assert result.max_load is None and not any(p.meets for p in result.probes)
    assert len(result.probes) <= 4


def test_find_max_rate_cli_writes_every_probe_as_json(capsys):
    argv = ["simulate", "--requests", "100", "--cache-gb", "2", "--no-progress", "--json",
            "--find-max-rate", "--slo", "ttft_p90=500", "--arrival-rate", "2", "--max-probes", "8"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["searched"] == "arrival_rate" and 1 <= len(d["probes"]) <= 8
    best = [p for p in d["probes"] if p["load"] == d["max_load"]][0]
    assert best["meets"] and best["p90_ttft_ms"] <= 500


def test_find_max_rate_without_slo_is_refused(capsys):
    assert main(["simulate", "--requests", "10", "--find-max-rate", "--no-progress"]) == 2
    assert "--slo" in capsys.readouterr().err


from hypothesis import given, settings, strategies as st  # noqa: E402

from vmemkv.scheduler.capacity import search_max_load  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(threshold=st.floats(0.05, 500.0), start=st.floats(0.5, 50.0), tol=st.floats(0.005, 0.5))
def test_search_brackets_any_threshold_within_the_tolerance(threshold, start, tol):
    """Against a shadow SLO (met iff load <= threshold) the answer is a met load within the
    tolerance of the first failing one, and the threshold lies between them."""
    seen = []

    def meets(load):
        seen.append(load)
        return load <= threshold

    lo, hi = search_max_load(meets, start, tol, max_probes=64)
    assert lo is not None and hi is not None
    assert lo <= threshold < hi and hi / lo <= 1 + tol
    assert len(seen) <= 64 and lo == max(x for x in seen if x <= threshold)


def test_search_that_runs_out_of_probes_reports_an_open_bracket():
    seen = []
    lo, hi = search_max_load(lambda load: seen.append(load) or True, 1.0, 0.02, max_probes=6)
    # every probe given doubles the load (it stopped at 3 of 6, then advised more probes)
    assert hi is None and lo == 32.0 and seen == [1, 2, 4, 8, 16, 32]


def test_an_interrupted_search_prints_the_probes_that_finished(monkeypatch, capsys):
    from vmemkv.scheduler import capacity
    calls, real = [], capacity.simulate

    def simulate(entries, config):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(entries, config)

    monkeypatch.setattr(capacity, "simulate", simulate)
    assert main(["simulate", "--requests", "50", "--cache-gb", "2", "--no-progress",
                 "--find-max-rate", "--slo", "ttft_p90=500", "--max-probes", "8"]) == 130
    out, err = capsys.readouterr()
    assert "interrupted after 2 probes: no answer" in out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["4", "8"]   # the two loads
    assert err == ("vmemkv simulate: interrupted; 2 of at most 8 probes had finished, listed "
                   "above; the search has no answer\n")


def test_halving_to_a_rate_the_workload_refuses_ends_the_bracket_not_the_run(capsys):
    # an SLO nothing meets halves the rate until the last arrival passes the clock's range:
    # that ConfigError ended the run (exit 2) and dropped every finished probe. The refusal
    # depends only on --requests and the rate (23 halvings from 0.01 for 20 requests), so short
    # requests (--max-len 64) on a small pool (--cache-gb 2) reach it: at the default 60 GB and
    # 4,096 tokens the 23 probes took 8 s, mostly checking the idle pool's integrity
    code = main(["simulate", "--requests", "20", "--find-max-rate", "--arrival-rate", "0.01",
                 "--slo", "ttft_p90=0.001", "--cache-gb", "2", "--max-len", "64",
                 "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["max_load"] is None and len(out["probes"]) >= 12
    assert all(not p["meets"] for p in out["probes"])
    with pytest.raises(ConfigError, match="arrival_rate"):     # the start itself: a user error
        find_max_load(lambda load: make_entries_refusing(load), SimConfig(), {"ttft_p90": 1.0})


def make_entries_refusing(load: float):
    raise ConfigError(f"WorkloadSpec.arrival_rate {load} is refused")
