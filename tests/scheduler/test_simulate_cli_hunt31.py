"""`vmemkv simulate` and `vmemkv sweep`: what a user gave is neither dropped nor replaced
silently (hunt 31). A list flag given twice, a JSON key given twice (a trace line, a sweep
spec), a trace's own LoRA adapters under --lora-adapters, and the flags that price a trace's
adapters (--h2d-gbps, --lora-budget-gb)."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.traces import load_trace

SIM = ["simulate", "--no-progress"]


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def refused(argv, capsys) -> str:
    code = exit_code(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,flag", [
    # the first list was dropped: the search ran with no TTFT target, the run with seed 5 only
    (["--find-max-rate", "--slo", "ttft_p90=500", "--slo", "tpot_p99=200"], "--slo"),
    (["--seeds", "0-1", "--seeds", "5"], "--seeds"),
])
def test_a_list_flag_given_twice_is_refused_naming_it(argv, flag, capsys):
    err = refused(SIM + ["--requests", "10"] + argv, capsys)
    assert f"argument {flag}: given twice" in err


def test_a_list_flag_given_once_still_runs_every_value(capsys):
    assert main(SIM + ["--requests", "10", "--cache-gb", "2", "--json", "--seeds", "0-1"]) == 0
    assert json.loads(capsys.readouterr().out)["seeds"] == [0, 1]


def _lines(path, *objects_or_text) -> str:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n"
                            for o in objects_or_text))
    return str(path)


@pytest.mark.parametrize("line,key", [
    ('{"prompt_len": 10, "prompt_len": 2000, "output_len": 5, "arrival_s": 0}', "prompt_len"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1], '
     '"timestamp": 9000}', "timestamp"),
])
def test_a_trace_line_giving_a_key_twice_is_refused_naming_line_and_key(tmp_path, line, key):
    path = _lines(tmp_path / "t.jsonl", {"prompt_len": 10, "output_len": 5, "arrival_s": 0}
                  if key == "prompt_len" else
                  {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
                  line)
    with pytest.raises(ConfigError) as error:
        load_trace(path)          # json kept the later value: 2000 tokens, 9 s, silently
    message = str(error.value)
    assert "t.jsonl line 2" in message and f"key '{key}' is given twice" in message


def test_a_json_sweep_spec_giving_a_key_twice_is_refused_before_anything_is_written(
        tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text('{"base": {"requests": 20, "cache_gb": 4, "cache_gb": 20}, '
                    '"grid": {"policy": ["paged", "vmem"]}}')
    out = tmp_path / "out"
    code = exit_code(["sweep", str(spec), "--out", str(out), "--no-plots", "--no-progress",
                      "--jobs", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "key 'cache_gb' is given twice" in err and "spec.json" in err, err
    assert not out.exists()       # it ran every point at cache_gb 20


def _adapter_trace(tmp_path) -> str:
    return _lines(tmp_path / "a.jsonl", *(
        {"prompt_len": 100 + i, "output_len": 20, "arrival_s": i * 0.01,
         "adapter": f"a{i % 4}", "adapter_bytes": 2**26} for i in range(12)))


def test_lora_adapters_with_a_trace_naming_its_own_is_refused(tmp_path, capsys):
    err = refused(SIM + ["--trace", _adapter_trace(tmp_path), "--cache-gb", "4",
                         "--lora-adapters", "2"], capsys)
    assert "--lora-adapters 2" in err and "names its own" in err and "'a0'" in err


def _run(argv, capsys) -> dict:
    assert main(SIM + ["--json"] + argv) == 0
    return json.loads(capsys.readouterr().out)


def test_h2d_gbps_prices_the_adapters_a_trace_names(tmp_path, capsys):
    trace = ["--trace", _adapter_trace(tmp_path), "--cache-gb", "4"]
    default = _run(trace, capsys)
    slow = _run(trace + ["--h2d-gbps", "1"], capsys)   # it was refused as doing nothing
    assert default["adapter_loads"] == slow["adapter_loads"] == 4
    assert slow["adapter_load_seconds"] == pytest.approx(4 * 2**26 / 1e9)
    assert default["adapter_load_seconds"] == pytest.approx(4 * 2**26 / 25e9)


def test_h2d_gbps_with_a_trace_naming_no_adapter_is_still_refused(tmp_path, capsys):
    path = _lines(tmp_path / "p.jsonl", {"prompt_len": 10, "output_len": 5, "arrival_s": 0})
    err = refused(SIM + ["--trace", path, "--cache-gb", "4", "--h2d-gbps", "3"], capsys)
    assert "--h2d-gbps 3" in err and "no request names an adapter" in err


def test_lora_budget_gb_splits_the_cache_for_a_trace_naming_adapters(tmp_path, capsys):
    trace = ["--trace", _adapter_trace(tmp_path), "--cache-gb", "4"]
    pooled = _run(trace, capsys)
    split = _run(trace + ["--lora-budget-gb", "0.2"], capsys)   # refused: "give --lora-adapters"
    assert (pooled["peak_adapters_resident"], pooled["adapter_evictions"]) == (4, 0)
    # 0.2 GB holds two of the four 64 MiB adapters: round-robin requests evict at every load
    assert (split["peak_adapters_resident"], split["adapter_loads"]) == (2, 12)
    assert split["config"]["lora_budget_gb"] == 0.2 and split["completed"] == 12


@pytest.mark.parametrize("how", ["same", "dotted", "link"])
def test_write_trace_onto_the_trace_it_replays_is_refused_and_the_trace_kept(
        tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    trace = _lines(tmp_path / "big.jsonl", *({"prompt_len": 5000 + i, "output_len": 10,
                                              "arrival_s": i} for i in range(20)))
    before = (tmp_path / "big.jsonl").read_bytes()
    target = {"same": "big.jsonl", "dotted": "./big.jsonl", "link": "link.jsonl"}[how]
    if how == "link":
        (tmp_path / "link.jsonl").symlink_to("big.jsonl")
    # it wrote 3 requests scaled to 4,096 tokens at twice the rate over the 20 of the file
    err = refused(SIM + ["--trace", trace, "--max-requests", "3", "--rate-scale", "2",
                         "--cache-gb", "4", "--write-trace", target], capsys)
    assert f"--write-trace {target} is the file --trace {trace} reads" in err
    assert (tmp_path / "big.jsonl").read_bytes() == before


def test_a_trace_naming_one_adapter_with_two_sizes_is_refused_naming_both_lines(tmp_path,
                                                                                 capsys):
    path = _lines(tmp_path / "t.jsonl",
                  {"prompt_len": 10, "output_len": 5, "arrival_s": 0, "adapter": "x",
                   "adapter_bytes": 100},
                  {"prompt_len": 10, "output_len": 5, "arrival_s": 100, "adapter": "y",
                   "adapter_bytes": 300},
                  {"prompt_len": 10, "output_len": 5, "arrival_s": 200, "adapter": "x",
                   "adapter_bytes": 200_000_000})
    with pytest.raises(ConfigError) as error:
        load_trace(path)          # the run failed at its third request: AdapterStateError
    assert "t.jsonl line 3: adapter 'x' with adapter_bytes 200000000" in str(error.value)
    assert "t.jsonl line 1 names it with 100" in str(error.value)
    err = refused(SIM + ["--trace", path, "--cache-gb", "2"], capsys)
    assert "ConfigError" in err and "line 3" in err
