"""Pins of the command lines' shared pieces (scheduler/cliargs.py, result_files.py,
field_checks.py, progress.py, cli_table.py) and of ``vmemkv simulate``'s flags: each test
holds one promise of a docstring or --help that a one-character change used to break unseen."""
from __future__ import annotations

import argparse
import io
import os
import sys

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import cliargs
from vmemkv.scheduler.cliargs import batch_by_ctx, parse_bytes, temp_prefix, thread_count
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.field_checks import check_fraction_or_none
from vmemkv.scheduler.progress import Progress
from vmemkv.scheduler.result_files import STALE_NAME, write_text


@pytest.mark.parametrize("text", ["0", "0 KiB", "0.5"])
def test_a_size_of_no_whole_byte_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes >= 1"):
        parse_bytes(text)
    assert parse_bytes("1") == 1 and parse_bytes("0.5KiB") == 512


@pytest.mark.parametrize("text", ["0x2048", "8x0"])
def test_a_batch_by_ctx_point_of_zero_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="both >= 1"):
        batch_by_ctx(text)
    assert tuple(batch_by_ctx("1x1")) == (1, 1)


def test_threads_stop_at_this_machines_cpu_count(monkeypatch):
    monkeypatch.setattr(cliargs, "max_threads", lambda: 4)
    assert thread_count("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="this machine has 4 CPUs"):
        thread_count("5")


def test_the_temporary_name_of_the_longest_name_fits_the_file_system():
    prefix = temp_prefix("/x/" + "a" * 255, 255)
    assert len(os.fsencode(prefix)) + len("XXXXXXXX.tmp") == 255


def test_rewriting_the_last_stale_file_removes_the_marker(tmp_path):
    (tmp_path / STALE_NAME).write_text("These files are from an earlier run: x.\na.json\n")
    write_text(str(tmp_path / "a.json"), "{}")
    assert sorted(os.listdir(tmp_path)) == ["a.json"]


@pytest.mark.parametrize("value", [1, 1.0, 0.5, None])
def test_a_fraction_may_be_the_whole_peak(value):
    check_fraction_or_none("CostModel.prefill_mfu", value)     # (0, 1]: 1 is in
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        check_fraction_or_none("CostModel.prefill_mfu", 1.01)


def test_the_progress_bar_draws_on_stderr_and_only_on_a_terminal(monkeypatch):
    err, out = io.StringIO(), io.StringIO()
    err.isatty = lambda: True
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setitem(sys.modules, "tqdm", None)       # our own bar, not tqdm's
    with Progress(3, "x") as bar:
        bar.update(3)
    assert "3/3" in err.getvalue() and out.getvalue() == ""
    piped = io.StringIO()                       # not a terminal: no bar
    with Progress(3, "x", stream=piped) as bar:
        bar.update(3)
    assert piped.getvalue() == ""


def test_a_closed_progress_bar_draws_nothing_more(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)       # our own bar, not tqdm's
    stream = io.StringIO()
    bar = Progress(3, "x", enabled=True, stream=stream)
    bar.close()
    written = stream.getvalue()
    bar.close()
    bar.update(1)
    assert stream.getvalue() == written and bar.count == 0


def test_seeds_count_up_and_stop_at_the_limit():
    from vmemkv.scheduler.cli_table import MAX_SEEDS, parse_seeds
    with pytest.raises(argparse.ArgumentTypeError, match="FIRST-LAST"):
        parse_seeds("4-2")
    assert parse_seeds("3-3") == [3]
    assert len(parse_seeds(f"0-{MAX_SEEDS - 1}")) == MAX_SEEDS
    with pytest.raises(argparse.ArgumentTypeError, match=f"is {MAX_SEEDS + 1:,} seeds"):
        parse_seeds(f"0-{MAX_SEEDS}")


def _table(**kwargs) -> list:
    from vmemkv.scheduler.cli_table import format_table
    run = {"policy": "vmem", "num_requests": 10, "kv_utilization": 0.5,
           "median_ttft_ms": 100.0, "p99_ttft_ms": 900.0,
           "config": {"model_preset": "llama-3-8b", "gpu": "h100", "cache_gb": 4}}
    return format_table(run, **kwargs).splitlines()


def test_the_table_shows_each_figure_in_its_unit_and_column():
    lines = _table()
    assert lines[0] == "vmemkv simulate: vmem, llama-3-8b on h100, 4 GB cache, 10 requests"
    utilisation = next(line for line in lines if "kv utilisation" in line)
    assert utilisation.split()[-2:] == ["50.0%", "-"]     # whole run; no steady state
    ttft = next(line for line in lines if "TTFT" in line)
    assert ttft.endswith("100 / 900")           # median first, then p99


def test_one_seed_is_no_mean_and_a_partial_steady_state_is_counted():
    assert "mean ± std" not in _table(seeds=[3])[0]
    lines = _table(std={"kv_utilization": 0.1}, seeds=[0, 1, 2],
                   counts={"steady_mean_batch": 2})
    assert lines[0].endswith(", mean ± std over seeds 0-2")
    assert lines[-1] == "  steady state over the 2 of 3 seeds whose runs had a queue"


def test_json_writes_infinity_and_nan_as_null():
    from vmemkv.scheduler.cli_table import to_json
    assert to_json({"a": float("inf"), "b": [float("-inf"), float("nan"), 1.5]}) == \
        '{"a": null, "b": [null, null, 1.5]}'


def test_the_capacity_answer_is_the_best_probes_request_rate():
    from vmemkv.scheduler.capacity import CapacityResult, Probe
    from vmemkv.scheduler.cli_capacity import _summary, format_search
    figures = {"request_throughput": 3.5, "output_throughput": 1200.0, "p90_ttft_ms": 400.0}
    result = CapacityResult(4.0, {"ttft_p90": 500.0}, [Probe(4.0, True, figures)], bounded=True)
    out = _summary(result, "arrival_rate")
    assert out["max_request_rate"] == 3.5 and out["max_load"] == 4.0
    assert "max arrival_rate meeting the SLO: 4 (3.500 requests/s completed)" in format_search(out)


def test_a_search_needs_two_probes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--find-max-rate", "--slo", "ttft_p90=500", "--max-probes", "1"])
    assert exit_.value.code == 2
    assert "--max-probes" in capsys.readouterr().err


def _simulate_args(*flags):
    from vmemkv.cli import build_parser
    return build_parser().parse_args(["simulate", *flags])


def test_simulate_flags_reach_the_config_in_their_units():
    from vmemkv.scheduler.cli import _config
    config = _config(_simulate_args("--cache-gb", "4", "--swap-gb", "2", "--preemption", "swap",
                                    "--map-latency-us", "30", "--h2d-gbps", "25",
                                    "--copy-gbps", "500", "--lora-budget-gb", "1",
                                    "--lora-adapters", "4"))
    assert config.cache_bytes == 4 * 10**9 and config.swap_bytes == 2 * 10**9   # GB, not GiB
    assert config.map_latency_s == pytest.approx(30e-6, rel=1e-12)     # us, not ms
    assert config.h2d_bytes_per_s == 25e9 and config.copy_bytes_per_s == 500e9
    assert config.adapter_budget_bytes == 10**9


def test_a_lora_budget_of_the_whole_cache_is_refused():
    from vmemkv.scheduler.cli_checks import check_lora
    check_lora(_simulate_args("--cache-gb", "4", "--lora-budget-gb", "3.9", "--lora-adapters", "2"))
    with pytest.raises(ConfigError, match="--lora-budget-gb 4 leaves no KV memory in --cache-gb 4"):
        check_lora(_simulate_args("--cache-gb", "4", "--lora-budget-gb", "4", "--lora-adapters", "2"))


def test_arrivals_may_reach_the_clock_limit_but_not_pass_it():
    from vmemkv.scheduler.cli_checks import check_arrival_rate
    from vmemkv.scheduler.trace_entry import MAX_ARRIVAL_S
    rate = 0.5
    at_limit = int(MAX_ARRIVAL_S * rate)            # the last arrival near MAX_ARRIVAL_S
    check_arrival_rate(argparse.Namespace(arrival_rate=rate, requests=at_limit, trace=None))
    with pytest.raises(ConfigError, match="--arrival-rate 0.5 requests/s puts --requests"):
        check_arrival_rate(argparse.Namespace(arrival_rate=rate, requests=at_limit + 1, trace=None))


@pytest.mark.parametrize("flags, words", [
    (["--seeds", "0-1", "--write-trace", "w.jsonl"], "--write-trace writes one workload and "
                                                     "--seeds draws 2"),
    (["--seeds", "0-1", "--trace", "w.jsonl"], "--seeds draws generated workloads"),
])
def test_flags_that_do_not_go_together_are_refused(flags, words):
    from vmemkv.scheduler.cli_checks import check_together
    with pytest.raises(ConfigError, match=words):
        check_together(_simulate_args(*flags))
    check_together(_simulate_args("--seeds", "0", "--write-trace", "w.jsonl"))
