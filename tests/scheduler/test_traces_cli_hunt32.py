"""Hunt 32, traces and the simulator CLI: a trace read from a pipe is read once (a sweep refuses
one), Mooncake lines refuse keys they do not read, a JSON string may hold U+2028 / U+2029 /
U+0085, ``--trace ""`` is refused, an SLO's median and p50 are one figure, an Azure count is
ASCII digits, and a sweep point whose trace changed since it was keyed fails naming it."""
import hashlib
import json
import os
import threading

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.capacity import parse_slo
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sweep import expand, load_spec, point_row
from vmemkv.scheduler.traces import load_trace


def mooncake_lines(count):
    return "".join(json.dumps({"timestamp": 100 * i, "input_length": 600, "output_length": 4,
                               "hash_ids": [1, i]}) + "\n" for i in range(count))


class Fifo:
    """A FIFO whose first reader gets ``text``, every later one nothing (as a shell pipe or
    /dev/stdin gives its text once)."""

    def __init__(self, path, text):
        self.path, self.text, self.stop = str(path), text.encode(), False
        os.mkfifo(self.path)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        first = True
        while not self.stop:
            with open(self.path, "wb") as f:      # waits for a reader
                if first and not self.stop:
                    f.write(self.text)
            first = False

    def close(self):
        self.stop = True
        for _ in range(100):
            if not self.thread.is_alive():
                return
            os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))   # wakes the writer
            self.thread.join(0.05)


@pytest.fixture
def fifo(tmp_path):
    pipes = []

    def make(text):
        pipes.append(Fifo(tmp_path / "trace.jsonl", text))
        return pipes[-1].path
    yield make
    for pipe in pipes:
        pipe.close()


def test_simulate_reads_a_piped_trace_once_when_a_check_reads_it_too(fifo, capsys):
    # --prefix-eviction asks whether the trace has hash ids: that read took the pipe's text,
    # and the run then found "trace ... has no requests" (exit 2)
    path = fifo(mooncake_lines(20))
    assert main(["simulate", "--trace", path, "--cache-gb", "1", "--prefix-eviction", "lru",
                 "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["completed"], out["total_input_tokens"]) == (20, 12000)


def test_find_max_rate_replays_a_piped_trace_at_every_probe(fifo, capsys):
    path = fifo(mooncake_lines(20))
    assert main(["simulate", "--trace", path, "--cache-gb", "1", "--find-max-rate",
                 "--slo", "ttft_p90=2000", "--max-probes", "3", "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["load"] for p in out["probes"]] == [1.0, 2.0, 4.0]
    assert [round(p["request_throughput"], 3) for p in out["probes"]] == [10.421, 20.634, 40.464]


def test_a_sweep_refuses_a_trace_that_is_a_pipe_by_name(tmp_path, fifo):
    # the sha256 that keys its rows read the pipe: the checks and every point read nothing
    pipe = fifo(mooncake_lines(20))
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"base": {"trace": str(pipe), "cache_gb": 1},
                                "grid": {"policy": ["paged", "vmem"]}}))
    with pytest.raises(ConfigError) as refused:
        expand(load_spec(str(spec)))
    assert str(refused.value) == (
        f"base.trace: trace {str(pipe)!r} ({os.path.realpath(pipe)}) is not a regular file (a "
        f"pipe or a device, read once): a sweep reads its trace for each point and keys their "
        f"rows by its sha256; write it to a file")


@pytest.mark.parametrize("key, value", [("adapter", "lora-a"), ("arrival_s", 5.0),
                                        ("prompt_len", 7)], ids=["adapter", "arrival_s",
                                                                 "prompt_len"])
def test_a_mooncake_line_with_a_key_it_does_not_read_is_refused_naming_it(tmp_path, key, value):
    # it was dropped silently: the request ran with no adapter, at its timestamp
    line = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [3], key: value}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError) as refused:
        load_trace(str(path))
    assert str(refused.value) == (f"{path} line 1: unknown key {key!r}; a Mooncake trace line "
                                  f"holds input_length, output_length, timestamp, hash_ids")


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"], ids=["u2028", "u2029", "u0085"])
def test_a_json_string_holding_a_unicode_line_separator_is_one_line(tmp_path, char):
    # str.splitlines split the line there: "line 1: not JSON (Unterminated string ...)"
    path = tmp_path / "t.jsonl"
    lines = [{"prompt_len": 10, "output_len": 2, "arrival_s": float(i), "adapter": f"a{char}b",
              "adapter_bytes": 100} for i in range(2)]
    text = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in lines)
    path.write_text(text, encoding="utf-8")
    assert [(e.arrival_s, e.adapter.name) for e in load_trace(str(path))] == [
        (0.0, f"a{char}b"), (1.0, f"a{char}b")]
    path.write_text(text + "[1]\n", encoding="utf-8")      # the lines keep their numbers
    with pytest.raises(ConfigError, match=r"t\.jsonl line 3: expected an object, got list"):
        load_trace(str(path))


def test_an_empty_trace_name_is_refused_not_read_as_no_trace(capsys):
    # it ran the generated standard workload (2,000 requests) and echoed "trace": ""
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--trace", "", "--requests", "5", "--no-progress"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "vmemkv simulate: error: argument --trace: needs a name, got ''")


@pytest.mark.parametrize("text, message", [
    ("ttft_p50=3000,ttft_median=4000",
     "SLO target 'ttft_median=4000' names median_ttft_ms again ('ttft_p50=3000' did: a median "
     "is p50): give each target once"),
    ("ttft_median=3000,ttft_p50.0=4000",
     "SLO target 'ttft_p50.0=4000' names p50_ttft_ms again ('ttft_median=3000' did: a median "
     "is p50): give each target once"),
], ids=["p50-then-median", "median-then-p50"])
def test_a_median_target_beside_the_same_p50_target_is_refused(text, message):
    # numpy's median is its 50th percentile: one figure was searched under two names
    with pytest.raises(ConfigError) as refused:
        parse_slo(text)
    assert str(refused.value) == message
    assert parse_slo("ttft_median=3000,tpot_p50=40") == {"ttft_median": 3000.0, "tpot_p50": 40.0}


@pytest.mark.parametrize("count", ["1_0", "\u0661\u0660"], ids=["underscore", "arabic-indic"])
def test_an_azure_count_that_is_not_ascii_digits_is_refused(tmp_path, count):
    # int() read "1_0" and Arabic-Indic digits as 10 tokens: JSON counts are plain digits
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    f"2023-11-16 18:15:46.5,{count},2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        load_trace(str(path))
    assert str(refused.value) == (f"{path} line 2: ContextTokens must be an int in "
                                  f"[1, 1,000,000,000], got {count!r}")


def test_a_sweep_point_whose_trace_changed_since_it_was_keyed_fails_naming_it(tmp_path):
    # a line added while the sweep ran was simulated, its row keyed by the old file's sha256
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 100, "output_len": 5, "arrival_s": i})
                             + "\n" for i in range(3)))
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"base": {"trace": str(trace), "cache_gb": 1},
                                "grid": {"policy": ["paged"]}}))
    point = expand(load_spec(str(spec)))[0]
    assert point_row(point)["completed"] == 3
    with open(trace, "a") as f:
        f.write(json.dumps({"prompt_len": 100, "output_len": 5, "arrival_s": 9}) + "\n")
    row = point_row(point)
    keyed = point["trace_sha256"]
    assert (row["trace_sha256"], "completed" in row) == (keyed, False)
    assert row["error"] == (
        f"ConfigError: trace {str(trace)!r}: {os.path.realpath(trace)} changed since the sweep "
        f"read it (sha256 "
        f"{keyed[:12]}..., now {hashlib.sha256(trace.read_bytes()).hexdigest()[:12]}...): this "
        f"point would run requests its row does not name; run it again (--resume runs the "
        f"points whose trace changed)")


def test_seeds_with_a_trace_draw_its_adapters_per_seed(capsys):
    """--seed is taken with --trace --lora-adapters (it draws each request's adapter), but
    --seeds was refused there as if it drew nothing ("--seeds draws generated workloads"). Each
    seed now draws its own adapters over the one trace; without --lora-adapters it is refused."""
    run = ["simulate", "--trace", "azure-conv", "--max-requests", "40", "--cache-gb", "4",
           "--lora-adapters", "4", "--no-progress", "--json"]
    assert main(run + ["--seeds", "0-1"]) == 0
    both = json.loads(capsys.readouterr().out)
    singles = []
    for seed in (0, 1):
        assert main(run + ["--seed", str(seed)]) == 0
        singles.append(json.loads(capsys.readouterr().out))
    assert both["seeds"] == [0, 1]
    drop = ("wall_seconds",)          # the host's time, not the simulation's
    runs = [{k: v for k, v in r.items() if k not in drop} for r in both["runs"]]
    assert runs == [{k: v for k, v in r.items() if k not in drop} for r in singles]
    assert runs[0] != runs[1]         # each seed drew its own adapters
    assert main(run[:7] + ["--no-progress", "--seeds", "0-1"]) == 2
    assert "--seeds draws generated workloads (or, with --lora-adapters" in capsys.readouterr().err
