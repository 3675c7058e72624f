"""The simulator hunt's fixes: a profile run's copies are never charged 0 s (refused without a
copy bandwidth), a sweep says which trace requests it scaled down, the prefix flags are
refused with a trace that shares nothing, an interrupted sweep with no row says it wrote
none, and the table's total token throughput names its unit (no torch)."""
import csv
import json
from dataclasses import replace

import pytest

from vmemkv.cli import INTERRUPTED_EXIT, main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT
from vmemkv.scheduler.sim_config import SimConfig
from vmemkv.scheduler.simulator import Simulator, simulate
from vmemkv.scheduler.traces import load_trace

from .test_cli_profile import write_profile

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4,
             weight_bytes=1_000_000, layer_windows=[None, None])
COEFFS = {**dict.fromkeys(FITTED, 0.0), "base_s": 1e-3, "per_new_token_s": 1e-5}
ENGINE = dict(cache="vmem", layout="per-layer", page_bytes=65536, max_batch=16, max_context=1024,
              max_tokens_per_step=4096)
# Mooncake-style: the second and third requests hit the first's prompt blocks (hash ids)
SHARED = [dict(prompt_len=600, output_len=8, arrival_s=0.0, hash_ids=[1, 2]),
          dict(prompt_len=600, output_len=8, arrival_s=0.5, hash_ids=[1, 2]),
          dict(prompt_len=700, output_len=8, arrival_s=1.0, hash_ids=[1, 3])]
PLAIN = [dict(prompt_len=40, output_len=8, arrival_s=0.0), dict(prompt_len=500, output_len=100,
                                                              arrival_s=0.1),
         dict(prompt_len=30, output_len=8, arrival_s=0.2)]


@pytest.fixture
def profile(tmp_path):
    return write_profile(tmp_path, MODEL, ENGINE, COEFFS)


def write_trace(tmp_path, rows, name) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def refused(argv, capsys) -> str:
    """simulate ``argv``: exit 2 and its one error line."""
    assert main(["simulate", "--no-progress", "--json"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def simulated(argv, capsys) -> dict:
    assert main(["simulate", "--no-progress", "--json"] + argv) == 0
    return json.loads(capsys.readouterr().out)


# -- 3: a profile has no device to default the copy bandwidth from --------------------------

PROFILE_RUN = ["--requests", "20", "--cache-gb", "0.01", "--max-len", "256"]


@pytest.mark.parametrize("forks", [["--n", "4"], ["--beam-width", "2"]])
def test_a_profile_run_that_forks_is_refused_without_copy_gbps(profile, capsys, forks):
    err = refused(PROFILE_RUN + ["--profile", profile] + forks, capsys)
    assert "measured no device copy bandwidth" in err and "give --copy-gbps" in err
    assert forks[0] in err


def test_a_profile_run_on_a_trace_with_hash_ids_is_refused_without_copy_gbps(profile, tmp_path,
                                                                            capsys):
    trace = write_trace(tmp_path, SHARED, "shared.jsonl")
    err = refused(["--trace", trace, "--cache-gb", "0.01", "--profile", profile], capsys)
    assert f"--trace {trace} (its prefix hits are copied)" in err and "--copy-gbps" in err
    slow = simulated(["--trace", trace, "--cache-gb", "0.01", "--profile", profile,
                      "--copy-gbps", "0.000001"], capsys)
    fast = simulated(["--trace", trace, "--cache-gb", "0.01", "--profile", profile,
                      "--copy-gbps", "1000"], capsys)
    assert slow["copied_kv_bytes"] == fast["copied_kv_bytes"] > 0
    # the copies are charged: at 1 kB/s the run outlasts its copies' bytes / 1000 seconds
    # (charged 0 s, it took the fast run's 1.01 s)
    assert fast["simulated_seconds"] < 2 < slow["copied_kv_bytes"] / 1000 \
        < slow["simulated_seconds"]


def test_a_profile_run_that_copies_nothing_needs_no_copy_gbps(profile, tmp_path, capsys):
    trace = write_trace(tmp_path, PLAIN, "plain.jsonl")   # no hash ids, no forks
    assert simulated(["--trace", trace, "--cache-gb", "0.01", "--profile", profile],
                     capsys)["copied_kv_bytes"] == 0
    assert simulated(PROFILE_RUN + ["--profile", profile], capsys)["num_requests"] == 20
    # a reserve policy copies nothing, forks or not
    out = simulated(PROFILE_RUN + ["--profile", profile, "--policy", "reserve-max", "--n", "2"],
                    capsys)
    assert out["copied_kv_bytes"] == 0


def test_simconfig_with_a_profile_refuses_forks_without_copy_bytes_per_s(profile):
    for forks in (dict(n=2), dict(beam_width=2)):
        with pytest.raises(ConfigError, match="copy_bytes_per_s None with profile .* give "
                                              "copy_bytes_per_s"):
            SimConfig(profile=profile, cache_bytes=10**7, max_seq_len=256, **forks)
        SimConfig(profile=profile, cache_bytes=10**7, max_seq_len=256, copy_bytes_per_s=1e9,
                  **forks)
        SimConfig(profile=profile, policy="reserve-max", cache_bytes=10**7, max_seq_len=256,
                  **forks)


def test_simulate_with_a_profile_refuses_entries_with_hash_ids_without_copy_bytes_per_s(
        profile, tmp_path):
    entries = load_trace(write_trace(tmp_path, SHARED, "shared.jsonl"))
    config = SimConfig(policy="vmem", profile=profile, cache_bytes=10**7, max_seq_len=1024,
                       page_bytes=65536)
    with pytest.raises(ConfigError, match="entries with hash ids .* give copy_bytes_per_s"):
        simulate(entries, config)
    slow = simulate(entries, replace(config, copy_bytes_per_s=1e3))
    fast = simulate(entries, replace(config, copy_bytes_per_s=1e12))
    assert slow.copied_kv_bytes == fast.copied_kv_bytes == 40960
    assert fast.simulated_seconds < 2 < 40960 / 1e3 < slow.simulated_seconds


def test_the_simulator_refuses_to_charge_a_copy_at_no_bandwidth(profile, tmp_path):
    """The backstop under SimConfig: a Simulator built by hand on a profile's cost, with no
    copy bandwidth, fails at the first copy instead of charging it 0 s."""
    from vmemkv.scheduler.sim_config import copy_seconds
    assert copy_seconds(4096, 2048.0) == 2.0
    with pytest.raises(ConfigError, match="copy_bytes_per_s None, and the run copied 40,960"):
        copy_seconds(40960, None)
    entries = load_trace(write_trace(tmp_path, SHARED, "shared.jsonl"))
    config = SimConfig(policy="vmem", profile=profile, cache_bytes=10**7, max_seq_len=1024,
                       page_bytes=65536, copy_bytes_per_s=1.0)
    manager = config.make_manager()
    sim = Simulator(manager, config.make_cost(manager.pages_per_map_op),
                    config.scheduler_for(manager))
    assert sim.copy_bytes_per_s is None
    with pytest.raises(ConfigError, match="copy_bytes_per_s None, and the run copied"):
        sim.run(entries)


# -- 4: the sweep says which trace requests it scaled down ----------------------------------

def sweep(tmp_path, spec: str, *extra) -> int:
    path = tmp_path / "spec.toml"
    path.write_text(spec)
    return main(["sweep", str(path), "--out", str(tmp_path / "out"), "--jobs", "1",
                 "--no-plots", "--no-progress", *extra])


def rows(tmp_path) -> list:
    return [json.loads(line) for line in open(tmp_path / "out" / "sweep.rows.jsonl")]


def test_a_sweep_counts_and_says_the_trace_requests_it_scaled_down(tmp_path, capsys):
    trace = write_trace(tmp_path, PLAIN, "plain.jsonl")      # one request of 600 tokens
    assert sweep(tmp_path, f'[base]\ntrace = "{trace}"\nmax_len = 256\n'
                           f'[grid]\npolicy = ["paged", "vmem"]\n') == 0
    err = capsys.readouterr().err
    assert [r["scaled_requests"] for r in rows(tmp_path)] == [1, 1]
    assert err.count("1 of 3 trace requests were longer than max_len 256 tokens and were "
                     "scaled down to it") == 2, err
    assert "point 1 (paged " in err and "point 2 (vmem " in err
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert [r["scaled_requests"] for r in csv.DictReader(f)] == ["1", "1"]


def test_a_generated_point_has_no_scaled_requests_and_an_older_journal_still_resumes(tmp_path,
                                                                                     capsys):
    spec = "[base]\nrequests = 5\nmax_len = 64\n[grid]\npolicy = [\"paged\", \"vmem\"]\n"
    assert sweep(tmp_path, spec) == 0
    assert [r["scaled_requests"] for r in rows(tmp_path)] == [None, None]
    # a journal written before the column: its rows are kept by --resume, the column empty
    old = [{k: v for k, v in r.items() if k != "scaled_requests"} for r in rows(tmp_path)]
    (tmp_path / "out" / "sweep.rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    capsys.readouterr()
    assert sweep(tmp_path, spec, "--resume") == 0
    out, err = capsys.readouterr()
    assert "# 2 rows kept from the journal (--resume)" in out and err == ""
    with open(tmp_path / "out" / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["policy"] for r in table] == ["paged", "vmem"]
    assert [r.get("scaled_requests", "") for r in table] == ["", ""]


# -- 5: the prefix flags with a trace that shares nothing -----------------------------------

@pytest.mark.parametrize("flags", [["--prefix-eviction", "off"], ["--prefix-eviction", "hits"],
                                   ["--policy", "vmem", "--prefix-block-tokens", "0"],
                                   ["--copy-gbps", "1"], ["--policy", "vmem", "--copy-gbps", "1"]])
def test_prefix_flags_are_refused_with_a_trace_without_hash_ids(tmp_path, capsys, flags):
    trace = write_trace(tmp_path, PLAIN, "plain.jsonl")
    err = refused(["--trace", trace] + flags, capsys)
    assert f"{flags[-2]} {flags[-1]} applies to " in err
    assert f"with --trace {trace} (no request has hash ids: it shares no prefix" in err
    assert err.rstrip().endswith("it would do nothing: drop it")


def test_the_same_flags_are_taken_where_the_trace_shares_or_forks_copy(tmp_path, capsys):
    plain = write_trace(tmp_path, PLAIN, "plain.jsonl")
    shared = write_trace(tmp_path, SHARED, "shared.jsonl")
    out = simulated(["--trace", plain, "--copy-gbps", "1", "--n", "2"], capsys)
    assert out["config"]["copy_gbps"] == 1.0
    out = simulated(["--trace", shared, "--policy", "vmem", "--prefix-block-tokens", "16",
                     "--prefix-eviction", "hits", "--copy-gbps", "1"], capsys)
    assert out["prefix_cache_hits"] > 0 and out["copied_kv_bytes"] > 0
    assert out["config"]["prefix_eviction"] == "hits"


# -- 6: an interrupted sweep with no finished row -------------------------------------------

def test_a_sweep_interrupted_before_any_point_finished_says_it_wrote_no_table(tmp_path, capsys,
                                                                            monkeypatch):
    from vmemkv.scheduler import cli_sweep
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.csv").write_text("an earlier run's table\n")

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_sweep, "run_local", ctrl_c)
    assert sweep(tmp_path, "[base]\nrequests = 5\n[grid]\ncache_gb = [1, 2]\n") == INTERRUPTED_EXIT
    err = capsys.readouterr().err
    assert "wrote 0" not in err and "no point had finished, so no table was written" in err
    assert f"sweep.csv in {out} are an earlier run's (listed in {out / 'STALE.txt'})" in err
    assert "run the sweep again to run its 2 points" in err
    assert (out / "sweep.csv").read_text() == "an earlier run's table\n"
    assert (out / "STALE.txt").read_text().splitlines()[1:] == ["sweep.csv"]


# -- 7: the table names the unit of total token throughput ----------------------------------

def test_the_table_gives_total_token_throughput_in_tok_per_s(capsys):
    assert main(["simulate", "--requests", "5", "--max-len", "64", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, line = lines[1], next(x for x in lines if "total token throughput" in x)
    # the label whole in its column, the value right-aligned under "whole run"
    assert line[:33] == "  total token throughput (tok/s) " and line[33] == " "
    end = header.index("whole run") + len("whole run")
    assert line[end - 1] != " " and line[end] == " "
