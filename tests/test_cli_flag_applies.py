"""A flag given where the other flags leave it nothing to do is refused by name (one line on
stderr, exit 2) before anything runs, in `vmemkv simulate`, `sweep` and `bench` as in `generate`
and `serve` (docs/usage.md: refused, not ignored); where it does apply, it is accepted."""
import json
import pathlib

import pytest

from vmemkv.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = ["simulate", "--requests", "5", "--cache-gb", "2", "--no-progress", "--json"]
TRACE = ["simulate", "--trace", "azure-conv", "--max-requests", "5", "--cache-gb", "2",
         "--no-progress", "--json"]
SWEEP = ["sweep", str(ROOT / "docs/examples/sweep.toml"), "--no-progress"]

# (argv, the flag the one-line refusal names, with its value where it has one)
IGNORED = [
    (SIM + ["--swap-gb", "1"], "--swap-gb 1"),                      # recompute preemption
    (SIM + ["--h2d-gbps", "10"], "--h2d-gbps 10"),                  # no adapters, no swap
    (SIM + ["--lora-zipf", "0.5"], "--lora-zipf 0.5"),              # no adapters
    (SIM + ["--beam-skew", "0.5"], "--beam-skew 0.5"),              # no beam search
    (SIM + ["--slo", "ttft_p90=500"], "--slo"),                     # no capacity search
    (SIM + ["--search-tolerance", "0.1"], "--search-tolerance 0.1"),
    (SIM + ["--max-probes", "5"], "--max-probes 5"),
    (SIM + ["--policy", "reserve-max", "--watermark", "0.05"], "--watermark 0.05"),
    (SIM + ["--policy", "vmem", "--watermark-scope", "all"], "--watermark-scope all"),
    (SIM + ["--seeds", "0-1", "--seed", "3"], "--seed 3"),
    (SIM + ["--policy", "vmem", "--block-size", "32"], "--block-size 32"),
    (SIM + ["--policy", "vmem", "--paged-slowdown", "1.5"], "--paged-slowdown 1.5"),
    (SIM + ["--layout", "interleaved"], "--layout interleaved"),    # the default policy: paged
    (SIM + ["--page-bytes", "64KiB"], "--page-size 65536"),
    (SIM + ["--map-latency-us", "5"], "--map-latency-us 5"),
    (SIM + ["--prefix-block-tokens", "32"], "--prefix-block-tokens 32"),
    (SIM + ["--policy", "vmem", "--prefix-block-tokens", "32"],     # nothing shared without a
     "--prefix-block-tokens 32"),                                   # trace's hash ids
    (SIM + ["--policy", "reserve-oracle", "--prefix-eviction", "hits"], "--prefix-eviction hits"),
    (TRACE + ["--requests", "7"], "--requests 7"),                  # the trace's own requests
    (TRACE + ["--arrival-rate", "3"], "--arrival-rate 3"),
    (TRACE + ["--prompt-median", "100"], "--prompt-median 100"),
    (TRACE + ["--workload-rng", "python"], "--workload-rng python"),
    (TRACE + ["--seed", "4"], "--seed 4"),                          # nothing drawn without LoRA
    (SWEEP + ["--ray", "local", "--jobs", "2"], "--jobs 2"),        # Ray runs the points
    (["bench", "--smoke", "--only", "alloc", "--kv-cache-dtype", "int8"], "--kv-cache-dtype int8"),
    (["bench", "--quick", "serve", "--url", "http://127.0.0.1:9", "--rate", "1",
      "--num-prompts", "1"], "--quick"),                            # serve runs no suite
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--rate", "1", "--num-prompts", "1"],
     "--out"),         # the suite's --out (inserted below) was dropped for serve's default
]


@pytest.mark.parametrize("argv,flag", IGNORED, ids=[flag for _, flag in IGNORED])
def test_a_flag_that_would_do_nothing_is_refused_by_name(argv, flag, tmp_path, capsys):
    if argv[0] in ("sweep", "bench"):
        argv = argv[:1] + ["--out", str(tmp_path / "out")] + argv[1:]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"vmemkv {argv[0]}"), err
    assert f"error: {flag} " in err.replace("ConfigError: ", "") and "drop" in err, err
    assert out == "" and not (tmp_path / "out").exists()     # nothing ran, nothing written


# flags where they apply, and what the run's echoed config says of them
APPLIED = [
    (["--swap-gb", "1", "--preemption", "swap"], {"swap_gb": 1.0, "preemption": "swap"}),
    (["--lora-adapters", "3", "--lora-zipf", "0.5", "--h2d-gbps", "10"],
     {"lora_zipf": 0.5, "h2d_gbps": 10.0}),
    (["--beam-width", "2", "--beam-skew", "0.5"], {"beam_skew": 0.5}),
    (["--policy", "vmem", "--page-bytes", "64KiB", "--layout", "interleaved", "--watermark",
      "0.05", "--map-latency-us", "5"],
     {"page_size_bytes": 65536, "layout": "interleaved", "map_latency_us": 5.0}),
    (["--policy", "reserve-max", "--watermark", "0.05", "--watermark-scope", "all"],
     {"watermark": 0.05, "watermark_scope": "all"}),
]


@pytest.mark.parametrize("extra,echoed", APPLIED, ids=lambda a: " ".join(a[:2]) if
                         isinstance(a, list) else "")
def test_the_same_flags_are_accepted_where_they_apply(extra, echoed, capsys):
    assert main(SIM + extra) == 0, capsys.readouterr().err
    config = json.loads(capsys.readouterr().out)["config"]
    assert {key: config[key] for key in echoed} == echoed


def test_the_prefix_flags_are_accepted_with_a_trace_that_shares_prefixes(capsys):
    argv = ["simulate", "--trace", "mooncake-conversation", "--max-requests", "5", "--cache-gb",
            "2", "--no-progress", "--json", "--policy", "vmem", "--prefix-block-tokens", "32",
            "--prefix-eviction", "hits"]
    assert main(argv) == 0, capsys.readouterr().err
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["prefix_block_tokens"], config["prefix_eviction"]) == (32, "hits")
