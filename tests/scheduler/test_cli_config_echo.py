"""`simulate --json`'s "config" names every flag that shaped the result, units in the name
where a value has them: runs with different --arrival-rate, --requests, length flags,
--kv-cache-dtype, --n, --prefill-mfu, --map-latency-us ... echoed byte-identical configs, and
page_size (bytes) said no unit."""
import json

from vmemkv.cli import main

BASE = ["simulate", "--json", "--no-progress", "--cache-gb", "4"]


def config_of(argv, capsys) -> dict:
    assert main(BASE + argv) == 0
    return json.loads(capsys.readouterr().out)["config"]


def test_every_flag_that_shapes_a_generated_run_is_echoed(capsys):
    # paged (the default policy) for its own flags; vmem below for the vmem-only ones and a
    # beam search for --beam-skew (each flag is refused where it would do nothing)
    config = config_of(["--requests", "12", "--arrival-rate", "50", "--kv-cache-dtype",
                        "fp8_e4m3", "--n", "2", "--prefill-mfu", "0.5",
                        "--output-mean", "100", "--output-p95", "300", "--prompt-median", "200",
                        "--prompt-p95", "900", "--copy-gbps", "800", "--paged-slowdown", "1.2"],
                       capsys)
    assert {k: config[k] for k in (
        "requests", "arrival_rate_per_s", "kv_cache_dtype", "n", "beam_width",
        "prefill_mfu", "output_mean_tokens", "output_p95_tokens",
        "prompt_median_tokens", "prompt_p95_tokens", "copy_gbps", "paged_slowdown",
        "rate_scale", "max_requests")} == {
        "requests": 12, "arrival_rate_per_s": 50.0, "kv_cache_dtype": "fp8_e4m3", "n": 2,
        "beam_width": 0, "prefill_mfu": 0.5,
        "output_mean_tokens": 100.0, "output_p95_tokens": 300.0, "prompt_median_tokens": 200.0,
        "prompt_p95_tokens": 900.0, "copy_gbps": 800.0, "paged_slowdown": 1.2,
        "rate_scale": None, "max_requests": None}      # --trace's: not this run's
    vmem = config_of(["--requests", "12", "--policy", "vmem", "--map-latency-us", "5",
                      "--page-size", "64KiB", "--beam-width", "2", "--beam-skew", "0.5"], capsys)
    assert {k: vmem[k] for k in ("map_latency_us", "page_size_bytes", "beam_width",
                                 "beam_skew")} == {
        "map_latency_us": 5.0, "page_size_bytes": 64 * 2**10, "beam_width": 2, "beam_skew": 0.5}
    assert "page_size" not in vmem                    # bytes, under a name that says so


def test_runs_with_different_workloads_echo_different_configs(capsys):
    one = config_of(["--requests", "10", "--arrival-rate", "1"], capsys)
    other = config_of(["--requests", "12", "--arrival-rate", "50", "--beam-width", "2"],
                      capsys)
    assert one != other
    assert (one["requests"], other["requests"], other["beam_width"]) == (10, 12, 2)


def test_a_trace_run_echoes_its_replay_flags_and_not_the_generators(capsys):
    config = config_of(["--trace", "azure-code", "--max-requests", "20", "--rate-scale", "3"],
                       capsys)
    assert (config["trace"], config["max_requests"], config["rate_scale"]) == (
        "azure-code", 20, 3.0)
    assert config["requests"] is None and config["arrival_rate_per_s"] is None
