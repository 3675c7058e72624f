"""The bundled real traces and the trace-file loaders, read from the real files."""
import gzip
import json

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.traces import (BUNDLED, MOONCAKE_BLOCK_TOKENS, fit_to_length, load_trace,
                                     prompt_token_ids, trace_names)
from vmemkv.scheduler.workload import TraceEntry, write_trace


@pytest.fixture(scope="module")
def traces():
    return {name: load_trace(name) for name in trace_names()}


def test_every_bundled_trace_has_its_documented_row_count(traces):
    assert {n: len(t) for n, t in traces.items()} == {
        "azure-conv": 19366, "azure-code": 8819,
        "mooncake-conversation": 12031, "mooncake-synthetic": 3993}
    assert {n: BUNDLED[n].rows for n in traces} == {n: len(t) for n, t in traces.items()}


def test_arrivals_start_at_zero_and_never_go_back(traces):
    for name, entries in traces.items():
        arrivals = [e.arrival_s for e in entries]
        assert arrivals[0] == 0.0, name
        assert all(a <= b for a, b in zip(arrivals, arrivals[1:])), name


def test_azure_conversation_first_rows_and_span_match_the_csv(traces):
    conv = traces["azure-conv"]
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert (conv[0].prompt_len, conv[0].output_len) == (374, 44)
    assert (conv[1].prompt_len, conv[1].output_len) == (396, 109)
    assert conv[1].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    # last row 19:14:08.4025270: 58 min 21.7219370 s after the first
    assert conv[-1].arrival_s == pytest.approx(58 * 60 + 21.7219370, abs=1e-5)
    assert all(not e.hash_ids for e in conv)


def test_mooncake_keeps_one_hash_id_per_512_token_block(traces):
    for name in ("mooncake-conversation", "mooncake-synthetic"):
        for e in traces[name]:
            assert len(e.hash_ids) == -(-e.prompt_len // MOONCAKE_BLOCK_TOKENS)
    first = traces["mooncake-conversation"][0]
    assert (first.prompt_len, first.output_len, first.arrival_s) == (6758, 500, 0.0)
    assert first.hash_ids == tuple(range(14))
    # the conversation trace shares blocks: the first four requests all start with block 0
    assert [e.hash_ids[0] for e in traces["mooncake-conversation"][:4]] == [0, 0, 0, 0]
    last = traces["mooncake-conversation"][-1]
    assert last.arrival_s == pytest.approx(3536.999)   # timestamps are milliseconds


def test_rate_scale_divides_arrivals_and_max_requests_keeps_the_first():
    full = load_trace("azure-code")
    fast = load_trace("azure-code", rate_scale=4.0, max_requests=100)
    assert len(fast) == 100
    assert [e.arrival_s for e in fast] == pytest.approx([e.arrival_s / 4.0 for e in full[:100]])
    assert [e.prompt_len for e in fast] == [e.prompt_len for e in full[:100]]


@pytest.mark.parametrize("kwargs, match", [
    ({"rate_scale": 0}, "rate_scale must be a finite number > 0, got 0"),
    ({"rate_scale": float("inf")}, "rate_scale"),
    ({"max_requests": 0}, "max_requests must be an int >= 1, got 0"),
    ({"max_requests": True}, "max_requests"),
])
def test_bad_replay_options_are_config_errors_naming_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        load_trace("azure-code", **kwargs)


def test_unknown_name_or_missing_file_names_the_bundled_traces(tmp_path):
    with pytest.raises(ConfigError, match="azure-conv, azure-code, mooncake-conversation"):
        load_trace(str(tmp_path / "missing.jsonl"))


def test_files_load_by_format_and_gz_is_decompressed(tmp_path, traces):
    mooncake = tmp_path / "m.jsonl.gz"
    mooncake.write_bytes(gzip.compress(
        b'{"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}\n'))
    assert load_trace(str(mooncake)) == [TraceEntry(600, 2, 1.5, (7, 8))]
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                     "2023-11-16 18:00:01.5000000,10,3\r\n2023-11-16 18:00:00.2500000,5,1\r\n")
    assert load_trace(str(azure)) == [TraceEntry(5, 1, 0.0), TraceEntry(10, 3, 1.25)]
    own = tmp_path / "own.jsonl"
    write_trace(str(own), traces["mooncake-synthetic"][:50])
    assert load_trace(str(own)) == traces["mooncake-synthetic"][:50]


@pytest.mark.parametrize("text, match", [
    ("TIMESTAMP,Prompt,Out\n", "expected the Azure columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,0,3\n", "line 2: ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,4,3\n", "line 2: TIMESTAMP 'yesterday'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,4\n", "expected 3 columns"),
    # "46.5e3" read as a fraction would be 500 seconds late
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5e3,4,3\n", "TIMESTAMP '.*46.5e3'"),
])
def test_bad_azure_rows_are_config_errors_naming_the_line(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_trace(str(path))


@pytest.mark.parametrize("obj, match", [
    ({"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}, "must list 2 ints"),
    ({"timestamp": -1, "input_length": 6, "output_length": 2, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 6, "output_length": 0, "hash_ids": [1]}, "output_length"),
])
def test_bad_mooncake_lines_are_config_errors_naming_the_line(tmp_path, obj, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    with pytest.raises(ConfigError, match=f"line 1: .*{match}"):
        load_trace(str(path))


GOOD_LINE = b'{"prompt_len": 5, "output_len": 3, "arrival_s": 0}\n'


BAD_FILES = [
    ("cut.jsonl.gz", gzip.compress(GOOD_LINE * 50, mtime=0)[:30], "not a whole gzip file"),
    ("junk.jsonl.gz", b"\x1f\x8b\x08\x00" + b"\xff" * 40, "not a whole gzip file"),
    ("deep.jsonl", b"[" * 100_000 + b"\n", "line 1: JSON nested too deeply"),
    ("digits.jsonl", b'{"prompt_len": 1' + b"0" * 5000 + b', "output_len": 3}\n', "line 1: not a trace line"),
    ("huge.jsonl", b'{"prompt_len": 100000000000000000000, "output_len": 3}\n',
     r"line 1: prompt_len must be an int in \[1, 1,000,000,000\], got 1e\+20"),
    ("inf.jsonl", b'{"prompt_len": 5, "output_len": 3, "arrival_s": 1e999}\n', "line 1: arrival_s"),
]


# named by file: an id made of the bytes would hold gzip's header time, and two xdist workers
# that collect in different seconds then disagree on the test names (CI fails at collection)
@pytest.mark.parametrize("name, data, match", BAD_FILES, ids=[name for name, _, _ in BAD_FILES])
def test_corrupt_or_overflowing_trace_files_are_config_errors(tmp_path, name, data, match):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match=match):
        load_trace(str(tmp_path / name))


def test_equal_hash_ids_give_equal_tokens_and_different_ids_differ():
    a = TraceEntry(1000, 1, 0.0, (3, 4))
    b = TraceEntry(700, 1, 0.0, (3, 5))
    ta, tb = prompt_token_ids(a, 32000), prompt_token_ids(b, 32000)
    assert (len(ta), len(tb)) == (1000, 700)
    assert ta[:512] == tb[:512] and ta[512:700] != tb[512:700]
    assert prompt_token_ids(TraceEntry(100, 1, 0.0, (4,)), 32000) == ta[512:612]
    assert all(1 <= t < 32000 for t in ta)
    assert prompt_token_ids(a, 32000, seed=1) != ta
    with pytest.raises(ConfigError, match="needs an entry with hash_ids"):
        prompt_token_ids(TraceEntry(10, 1, 0.0), 32000)


def test_fit_to_length_scales_long_requests_in_proportion_and_keeps_short_ones():
    entries = [TraceEntry(3000, 1000, 0.0, tuple(range(6))), TraceEntry(100, 50, 1.0)]
    fitted, scaled = fit_to_length(entries, 2000)
    assert scaled == 1
    assert fitted[1] == entries[1]
    assert (fitted[0].prompt_len, fitted[0].output_len) == (1500, 500)
    assert fitted[0].hash_ids == (0, 1, 2)
    tiny, _ = fit_to_length([TraceEntry(10_000, 1, 0.0)], 2)
    assert (tiny[0].prompt_len, tiny[0].output_len) == (1, 1)


def test_a_request_exactly_max_len_long_is_kept_and_not_counted_as_scaled():
    """Only requests longer than max_len are scaled (the count a run reports)."""
    exact = [TraceEntry(1500, 500, 0.0, (7, 8, 9)), TraceEntry(1999, 1, 1.0)]
    assert fit_to_length(exact, 2000) == (exact, 0)


def test_simulate_replays_a_bundled_trace_by_name(capsys):
    from vmemkv.cli import main
    assert main(["simulate", "--trace", "azure-conv", "--max-requests", "150", "--rate-scale", "2",
                 "--policy", "vmem", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_requests"] == 150 and out["config"]["trace"] == "azure-conv"


def test_simulate_scales_requests_longer_than_max_len_and_says_so(capsys):
    from vmemkv.cli import main
    assert main(["simulate", "--trace", "mooncake-conversation", "--max-requests", "40",
                 "--max-len", "8192", "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "longer than --max-len 8192 tokens and were scaled down" in captured.err
    assert json.loads(captured.out)["num_requests"] == 40


def test_rate_scale_without_a_trace_is_refused():
    from vmemkv.cli import main
    assert main(["simulate", "--requests", "10", "--rate-scale", "2"]) == 2
