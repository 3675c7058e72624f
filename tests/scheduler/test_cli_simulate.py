"""`vmemkv simulate` through the real CLI entry point."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.cli import parse_bytes

FAST = ["simulate", "--requests", "40", "--cache-gb", "4", "--no-progress"]


def test_json_is_one_object_with_the_documented_keys(capsys):
    assert main(FAST + ["--json", "--policy", "vmem", "--layout", "interleaved"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    d = json.loads(out)
    for key in ("mean_batch", "kv_utilization", "output_tokens_per_s", "num_preemptions",
                "recomputed_tokens", "mean_end_waste_tokens", "simulated_seconds", "wall_seconds"):
        assert isinstance(d[key], (int, float)), key
    assert d["policy"] == "vmem" and d["num_requests"] == 40
    assert d["config"]["layout"] == "interleaved"


def test_table_is_readable(capsys):
    assert main(FAST + ["--policy", "reserve-oracle"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vmemkv simulate: reserve-oracle, llama-3-8b on h100, 4 GB cache, 40 requests")
    assert "output tokens/s" in out and "kv utilisation" in out


def test_write_trace_then_replay_gives_the_same_result(tmp_path, capsys):
    trace = str(tmp_path / "w.jsonl")
    assert main(FAST + ["--json", "--write-trace", trace, "--arrival-rate", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--trace", trace, "--cache-gb", "4", "--json", "--no-progress"]) == 0
    second = json.loads(capsys.readouterr().out)
    for d in (first, second):
        d.pop("wall_seconds"), d.pop("config")
    assert first == second


@pytest.mark.parametrize("argv", [
    ["--page-size", "3XB"], ["--page-size", "0"], ["--watermark", "1.5"], ["--cache-gb", "-1"],
    ["--swap-gb", "-2"], ["--policy", "lru"], ["--layout", "diagonal"], ["--requests", "ten"],
    ["--requests", "0"], ["--output-mean", "500", "--output-p95", "400"],
    ["--preemption", "drop"], ["--max-len", "10000001"],
    ["--max-running", "64", "--max-tokens-per-step", "32"], ["--trace", "/no/such/file.jsonl"],
    ["--policy", "reserve-max", "--cache-gb", "0.1"],
])
def test_bad_flag_value_exits_2_with_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["simulate", "--requests", "5", "--no-progress"] + argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "error" in err


@pytest.mark.parametrize("argv,words", [
    (["--cache-gb", "inf"], ["--cache-gb", "finite", "'inf'"]),
    (["--cache-gb", "nan"], ["--cache-gb", "finite", "'nan'"]),
    (["--swap-gb", "nan"], ["--swap-gb", "finite", "'nan'"]),
    (["--cache-gb", "0"], ["--cache-gb", "got 0"]),
    (["--cache-gb", "1e308"], ["--cache-gb", "1000000", "got 1e308"]),   # was OverflowError
    (["--swap-gb", "1e308"], ["--swap-gb", "1000000", "got 1e308"]),
    (["--cache-gb", "1000"], ["--cache-gb 1000", "llama-3-8b", "16.1 GB of weights",
                              "h100's 85.9 GB", "at most --cache-gb 69.8"]),
    (["--gpu", "h200", "--model-preset", "opt-13b", "--cache-gb", "120"], ["opt-13b", "h200's 141.0 GB"]),
    (["--preemption", "swap"], ["--preemption swap", "--swap-gb > 0"]),
    (["--block-size", "100000"], ["--block-size 100000", "--max-len 4096"]),
    (["--device", "h100"], ["--device is --gpu in simulate", "cpu or cuda"]),
    (["--model", "llama-3-8b"], ["--model is --model-preset in simulate", "checkpoint"]),
    (["--watermark", "nan"], ["--watermark", "finite"]),
])
def test_refused_value_is_one_line_naming_the_flag_and_the_limit(capsys, argv, words):
    try:
        code = main(["simulate", "--requests", "5", "--no-progress"] + argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vmemkv simulate: error: "), err
    for word in words:
        assert word in err, (word, err)


def test_deployment_flags_name_the_preset_and_the_gpu(capsys):
    assert main(FAST + ["--model-preset", "tiny", "--gpu", "h200", "--page-bytes", "64KiB",
                        "--policy", "vmem", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["model_preset"], config["gpu"], config["page_size_bytes"]) == ("tiny", "h200", 64 * 2**10)


def test_bad_trace_line_names_the_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 5, "arrival_s": 0}\n{"prompt_len": -5, "output_len": 5}\n')
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and err.count("\n") == 1


@pytest.mark.parametrize("text,value", [("2097152", 2 * 2**20), ("2MiB", 2 * 2**20),
                                        ("64 KiB", 64 * 2**10), ("1GB", 10**9), ("4096b", 4096)])
def test_page_size_accepts_bytes_and_binary_suffixes(text, value):
    assert parse_bytes(text) == value


def test_progress_bar_draws_on_its_stream_and_clears_itself():
    import io
    from vmemkv.scheduler.progress import Progress
    stream = io.StringIO()
    with Progress(10, "sim", enabled=True, stream=stream) as bar:
        bar._tqdm = None            # exercise our own bar even where tqdm is installed
        bar.update(10)
    assert "10/10" in stream.getvalue() and stream.getvalue().endswith("\r")


def test_progress_bar_is_silent_when_disabled():
    import io
    from vmemkv.scheduler.progress import Progress
    stream = io.StringIO()
    with Progress(10, "sim", enabled=False, stream=stream) as bar:
        bar.update(5)
    assert stream.getvalue() == ""
