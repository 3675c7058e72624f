"""What a run reports means what the docs say: throughput over simulated seconds (idle time
between arrivals included), swap copies charged as time, steady-state figures absent (not 0)
when no step had a queue, and JSON that a strict parser reads."""
import json
from dataclasses import replace

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.cli_table import aggregate, format_table
from vmemkv.scheduler.presets import get_device
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry, WorkloadSpec, generate, write_trace

STEADY_MEANS = ("steady_mean_batch", "steady_kv_utilization", "steady_held_utilization",
                "steady_kv_cache_usage_perc", "steady_mean_end_waste_tokens",
                "steady_output_tokens_per_s")


def test_whole_run_throughput_counts_the_idle_time_between_arrivals():
    """20 requests at 0.5/s: the GPU idles most of the run. Before, the whole run's tokens/s
    divided by the busy steps' time only (267.8 against 141.1 in the audit)."""
    entries = generate(WorkloadSpec(num_requests=20, arrival_rate=0.5, seed=1))
    r = simulate(entries, SimConfig(cache_bytes=4 * 10**9))
    assert r.simulated_seconds > entries[-1].arrival_s > 20
    assert r.output_tokens_per_s == r.output_tokens / r.simulated_seconds
    # the report's output_throughput counts from the first arrival; ours from time 0
    served = r.serving["output_throughput"] * r.serving["duration"]
    assert served == pytest.approx(r.output_tokens)
    assert r.output_tokens_per_s == pytest.approx(served / r.simulated_seconds)
    batch = simulate(generate(WorkloadSpec(num_requests=60)), SimConfig(cache_bytes=4 * 10**9))
    assert batch.output_tokens_per_s == batch.output_tokens / batch.simulated_seconds


@pytest.mark.parametrize("extra", [{"n": 4}, {"beam_width": 4}])
def test_output_throughput_counts_every_sample_and_beam_latencies_the_first(extra):
    """--n 4 / --beam-width 4: output_throughput counted only each request's first sample
    (5,383.6 against 21,534.2 tok/s with every arrival at 0, where the docs say they agree)."""
    entries = generate(WorkloadSpec(num_requests=30, max_total_len=512, seed=2))
    r = simulate(entries, SimConfig(cache_bytes=4 * 10**9, **extra))
    one = sum(e.output_len for e in entries)
    assert r.output_tokens == 4 * one
    s = r.serving
    assert s["total_output_tokens"] == 4 * one
    assert s["output_throughput"] * s["duration"] == pytest.approx(4 * one)
    assert s["output_throughput"] == pytest.approx(r.output_tokens_per_s)   # all at time 0
    assert s["completed"] == 30 and [t.output_tokens for t in r.timings] == [
        e.output_len for e in entries]             # TTFT, TPOT, ITL: the first sample's times


SWAP = SimConfig(cache_bytes=3 * 10**9, swap_bytes=10**9,
                 scheduler=SchedulerConfig(preemption="swap"))


def test_swap_copies_are_charged_at_the_host_to_device_bandwidth():
    """Swap and recompute runs gave bit-identical simulated seconds: SwapOut / SwapIn moved
    gigabytes over PCIe for free. The same run with a bandwidth too high to cost anything is
    the run without those transfers: the difference is exactly bytes / bandwidth."""
    entries = generate(WorkloadSpec(num_requests=100))
    charged = simulate(entries, SWAP)
    free = simulate(entries, replace(SWAP, h2d_bytes_per_s=1e300))
    assert charged.num_swap_preemptions == free.num_swap_preemptions > 0
    assert charged.swapped_kv_bytes == free.swapped_kv_bytes > 0
    bytes_per_token = SWAP.model_spec.bytes_per_token
    assert charged.swapped_kv_bytes % bytes_per_token == 0     # whole tokens, out and back in
    seconds = charged.swapped_kv_bytes / SWAP.h2d_bytes_per_s
    assert charged.swap_seconds == pytest.approx(seconds, rel=1e-12)
    assert charged.simulated_seconds - free.simulated_seconds == pytest.approx(seconds, rel=1e-9)
    assert charged.num_steps == free.num_steps


def test_a_run_without_swaps_is_charged_no_swap_time():
    r = simulate(generate(WorkloadSpec(num_requests=100)),
                 replace(SWAP, scheduler=SchedulerConfig(preemption="recompute")))
    assert r.num_preemptions > 0 and r.swapped_kv_bytes == 0 and r.swap_seconds == 0.0


def test_copies_default_to_half_the_device_memory_bandwidth():
    """copy_bytes_per_s None (--copy-gbps left out): a device copy reads and writes each byte,
    so it runs at half the memory bandwidth (docs/simulation.md), not the whole of it."""
    entries = generate(WorkloadSpec(num_requests=20, max_total_len=512, seed=3))
    config = SimConfig(policy="paged", cache_bytes=10**9, n=2)   # copy-on-write after the fork
    half = get_device(config.device).memory_bandwidth_bytes_per_s / 2
    default = simulate(entries, config)
    assert default.copied_kv_bytes > 0
    assert default.simulated_seconds == simulate(entries, replace(
        config, copy_bytes_per_s=half)).simulated_seconds
    assert default.simulated_seconds > simulate(entries, replace(
        config, copy_bytes_per_s=2 * half)).simulated_seconds


def test_steady_figures_are_absent_when_no_step_had_a_queue():
    r = simulate(generate(WorkloadSpec(num_requests=5)), SimConfig(cache_bytes=4 * 10**9))
    assert r.steady["steady_steps"] == 0 and r.steady["steady_seconds"] == 0.0
    d = r.to_dict()
    assert all(d[k] is None for k in STEADY_MEANS), {k: d[k] for k in STEADY_MEANS}
    table = format_table(dict(d, config={"model_preset": "m", "gpu": "g", "cache_gb": 4}))
    row = next(line for line in table.splitlines() if "output tokens/s" in line)
    assert row.split()[-1] == "-"


def test_seed_means_leave_out_the_runs_without_a_steady_state():
    stats = aggregate([{"steady_mean_batch": None, "mean_batch": 2.0},
                       {"steady_mean_batch": 4.0, "mean_batch": 4.0},
                       {"steady_mean_batch": 6.0, "mean_batch": 6.0}])
    assert stats["mean"] == {"steady_mean_batch": 5.0, "mean_batch": 4.0}
    assert stats["std"]["steady_mean_batch"] == 1.0
    assert stats["counts"] == {"steady_mean_batch": 2}
    none = aggregate([{"steady_mean_batch": None, "mean_batch": 1.0}] * 2)
    assert "steady_mean_batch" not in none["mean"] and "counts" not in none


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_json_writes_null_for_figures_that_are_not_numbers(tmp_path, capsys):
    """Requests of one output token have no TPOT: the figure is NaN, which is not JSON."""
    trace = str(tmp_path / "one.jsonl")
    write_trace(trace, [TraceEntry(100, 1, 0.0), TraceEntry(200, 1, 0.0)])
    assert main(["simulate", "--trace", trace, "--cache-gb", "4", "--json", "--no-progress"]) == 0
    d = _strict(capsys.readouterr().out)
    assert d["mean_tpot_ms"] is None and d["p99_tpot_ms"] is None
    assert d["steady_mean_batch"] is None and d["output_tokens"] == 2


def test_seeds_json_is_strict_and_each_run_names_its_own_seed(capsys):
    argv = ["simulate", "--requests", "30", "--cache-gb", "3", "--no-progress", "--seeds", "1,5,9"]
    assert main(argv + ["--json"]) == 0
    d = _strict(capsys.readouterr().out)
    assert d["seeds"] == [1, 5, 9]
    assert [r["config"]["seed"] for r in d["runs"]] == [1, 5, 9]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("mean ± std over seeds 1, 5, 9")
