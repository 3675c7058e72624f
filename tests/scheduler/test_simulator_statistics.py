"""Steady-state figures beside whole-run ones, the watermark's scope, and mean ± std over seeds."""
import argparse
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import cli_table
from vmemkv.scheduler.cli_table import MAX_SEEDS, aggregate, parse_seeds
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

WORK = generate(WorkloadSpec(num_requests=300, seed=2))
SMALL_CACHE = 4 * 10**9


def run(**kwargs):
    sched = SchedulerConfig(watermark=kwargs.pop("watermark", 0.05))
    return simulate(WORK, SimConfig(cache_bytes=SMALL_CACHE, scheduler=sched, **kwargs))


def test_steady_state_batch_and_throughput_exceed_the_drain_tail_diluted_means():
    d = run(policy="paged").to_dict()
    assert 0 < d["steady_steps"] < d["num_steps"]
    assert d["steady_mean_batch"] > d["mean_batch"]
    assert d["steady_output_tokens_per_s"] > d["output_tokens_per_s"]
    assert d["steady_seconds"] < d["simulated_seconds"]


def test_whole_run_throughput_is_output_tokens_over_simulated_seconds():
    r = run(policy="vmem")
    assert r.output_tokens_per_s == pytest.approx(r.output_tokens / r.simulated_seconds)


def test_growing_scope_exempts_reserve_policies_from_the_watermark():
    exempt = run(policy="reserve-oracle", watermark=0.2)
    no_watermark = run(policy="reserve-oracle", watermark=0.0)
    everywhere = run(policy="reserve-oracle", watermark=0.2, watermark_scope="all")
    assert exempt.simulated_seconds == no_watermark.simulated_seconds
    assert everywhere.mean_batch < exempt.mean_batch


def test_growing_scope_keeps_the_watermark_for_paged():
    assert (run(policy="paged", watermark=0.2).mean_batch
            == run(policy="paged", watermark=0.2, watermark_scope="all").mean_batch)
    assert run(policy="paged", watermark=0.2).mean_batch < run(policy="paged", watermark=0.0).mean_batch


def test_unknown_watermark_scope_names_the_field():
    with pytest.raises(ConfigError, match="watermark_scope"):
        SimConfig(watermark_scope="some")


def test_every_request_reports_its_output_tokens_with_times():
    r = run(policy="paged")
    assert [t.output_tokens for t in r.timings] == [e.output_len for e in WORK]
    assert r.serving["total_output_tokens"] == r.output_tokens
    assert r.serving["completed"] == len(WORK)


@pytest.mark.parametrize("text,seeds", [("0-4", [0, 1, 2, 3, 4]), ("1,5,9", [1, 5, 9]),
                                        ("3", [3]), ("0-1,7", [0, 1, 7])])
def test_seed_lists_parse(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text, count", [("0-10000", "10,001"), ("0-5000,6000-11000", "10,002")])
def test_more_seeds_than_the_bound_are_refused_naming_the_count(text, count):
    assert len(parse_seeds("0-9999")) == MAX_SEEDS == 10_000
    with pytest.raises(argparse.ArgumentTypeError,
                       match=f"'{text}' is {count} seeds, more than 10,000"):
        parse_seeds(text)


def test_a_huge_seed_range_is_a_usage_error_before_anything_is_built(capsys, monkeypatch):
    # 0-400000000 built 400 M ints and a Counter: a MemoryError traceback, exit 1
    monkeypatch.setattr(cli_table, "Counter", None)     # refused before the list is counted
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--requests", "10", "--seeds", "0-400000000", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seeds: '0-400000000' is 400,000,001 seeds, more than 10,000" in err
    assert "Traceback" not in err


def test_aggregate_is_the_mean_and_population_std_of_each_figure():
    stats = aggregate([{"a": 1.0, "b": "x"}, {"a": 3.0, "b": "y"}])
    assert stats == {"mean": {"a": 2.0}, "std": {"a": 1.0}}


def test_seeds_flag_reports_each_run_and_their_mean(capsys):
    argv = ["simulate", "--requests", "60", "--cache-gb", "4", "--no-progress", "--json"]
    assert main(argv + ["--seeds", "0-2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["seeds"] == [0, 1, 2] and len(d["runs"]) == 3
    singles = []
    for seed in (0, 1, 2):
        assert main(argv + ["--seed", str(seed)]) == 0
        singles.append(json.loads(capsys.readouterr().out)["output_tokens_per_s"])
    assert d["mean"]["output_tokens_per_s"] == pytest.approx(sum(singles) / 3)
    assert d["std"]["output_tokens_per_s"] > 0


def test_seeds_with_a_trace_is_refused(capsys):
    assert main(["simulate", "--trace", "azure-code", "--seeds", "0-1", "--no-progress"]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_goodput_flag_adds_request_goodput(capsys):
    assert main(["simulate", "--requests", "60", "--cache-gb", "4", "--no-progress", "--json",
                 "--goodput", "ttft:2000", "tpot:200"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert 0 <= d["request_goodput"] <= d["request_throughput"]
