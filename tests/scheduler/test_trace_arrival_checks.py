"""A trace line's arrival is required, a file holds one JSONL format, and `max_requests` keeps
the first N lines only where they are in arrival order (small files written to tmp_path)."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.trace_entry import TraceEntry
from vmemkv.scheduler.traces import load_trace


def project(prompt_len, arrival_s):
    return {"prompt_len": prompt_len, "output_len": 5, "arrival_s": arrival_s}


def mooncake(input_length, timestamp_ms):
    return {"input_length": input_length, "output_length": 5, "hash_ids": [1],
            "timestamp": timestamp_ms}


def write_lines(tmp_path, objects, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    return str(path)


def refusal(path, **kw):
    with pytest.raises(ConfigError) as refused:
        load_trace(path, **kw)
    return str(refused.value)


# --- the arrival is required ----------------------------------------------------------------

def test_a_project_line_without_arrival_s_is_refused_naming_line_and_field(tmp_path):
    path = write_lines(tmp_path, [project(100, 0.0), {"prompt_len": 100, "output_len": 5}])
    assert refusal(path) == (f"{path} line 2: no arrival_s; every line needs its arrival, a "
                             f"number of seconds >= 0 after the trace's start")


def test_a_mooncake_line_without_timestamp_is_refused_naming_line_and_field(tmp_path):
    line = mooncake(500, 9000)
    del line["timestamp"]
    path = write_lines(tmp_path, [line, mooncake(500, 9000)])
    assert refusal(path) == (f"{path} line 1: no timestamp; every line needs its arrival, a "
                             f"number of ms >= 0 after the trace's start")


@pytest.mark.parametrize("key", ["arrival", "hash_id", "timestamp"])
def test_a_misspelt_or_foreign_key_in_a_project_line_is_refused_by_name(tmp_path, key):
    line = project(100, 0.0)
    line[key] = 10.0
    path = write_lines(tmp_path, [project(100, 0.0), line])
    assert refusal(path) == (f"{path} line 2: unknown key {key!r}; a trace line holds "
                             f"prompt_len, output_len, arrival_s and may hold hash_ids, adapter, "
                             f"adapter_bytes")


def test_arrivals_given_are_kept_in_seconds_for_both_formats(tmp_path):
    assert load_trace(write_lines(tmp_path, [project(100, 10.0), project(200, 2.5)])) == [
        TraceEntry(200, 5, 2.5), TraceEntry(100, 5, 10.0)]
    loaded = load_trace(write_lines(tmp_path, [mooncake(500, 9000), mooncake(500, 250)], "m.jsonl"))
    assert [e.arrival_s for e in loaded] == [0.25, 9.0]


# --- one format a file ----------------------------------------------------------------------

def test_a_project_line_after_a_mooncake_first_line_is_refused(tmp_path):
    path = write_lines(tmp_path, [mooncake(500, 9000), project(600, 9000)])
    assert refusal(path) == (
        f"{path} line 2: a line of the project (prompt_len, output_len, arrival_s in s) format "
        f"in a trace whose first line ({path} line 1) is of the Mooncake (input_length, "
        f"output_length, timestamp in ms) format; a file holds one format")


def test_a_mooncake_line_after_project_lines_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + json.dumps(project(600, 9.0)) + "\n" + json.dumps(project(600, 10.0))
                    + "\n\n" + json.dumps(mooncake(500, 9000)) + "\n")
    message = refusal(str(path))
    assert message.startswith(f"{path} line 5: a line of the Mooncake (input_length, ")
    assert f"whose first line ({path} line 2) is of the project (" in message


def test_a_line_with_neither_formats_key_is_read_in_the_files_format(tmp_path):
    path = write_lines(tmp_path, [mooncake(500, 9000), {"output_length": 5, "timestamp": 1}])
    assert refusal(path) == (f"{path} line 2: input_length must be an int in "
                             f"[1, 1,000,000,000], got None")


# --- max_requests keeps the first N lines, which must be in arrival order -------------------

def test_max_requests_refuses_a_line_arriving_before_the_line_above_it(tmp_path):
    path = write_lines(tmp_path, [project(100, 0.0), project(200, 50.0), project(300, 10.0),
                                  project(400, 60.0)])
    assert refusal(path, max_requests=3) == (
        f"{path} line 3: arrives 40 s before the line above it ({path} line 2); max_requests "
        f"(--max-requests) keeps the first N lines, the first N by arrival only in a trace in "
        f"arrival order: sort the file by arrival, or read it all (no max_requests)")
    # line 3 is among the first 2 by arrival, so 2 is refused too (it kept [100, 200])
    assert refusal(path, max_requests=2).startswith(
        f"{path} line 3: arrives 40 s before the line above it ({path} line 2), the last of ")
    assert [e.prompt_len for e in load_trace(path, max_requests=1)] == [100]
    assert [e.prompt_len for e in load_trace(path)] == [100, 300, 200, 400]


def test_max_requests_keeps_ties_in_file_order_and_reads_one_line_further(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(project(n, 5.0)) + "\n" for n in (300, 100, 200, 400))
                    + "not json\n")
    assert [e.prompt_len for e in load_trace(str(path), max_requests=3)] == [300, 100, 200]


def test_max_requests_refuses_an_azure_row_stamped_before_the_row_above_it(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.5000000,100,5\n"
                    "2023-11-16 18:15:46.2500000,200,5\n")
    assert refusal(str(path), max_requests=2).startswith(
        f"{path} line 3: arrives 0.25 s before the line above it ({path} line 2); ")
    assert load_trace(str(path)) == [TraceEntry(200, 5, 0.0), TraceEntry(100, 5, 0.25)]


def test_simulate_max_requests_on_an_unsorted_trace_is_one_line_naming_it(tmp_path, capsys):
    path = write_lines(tmp_path, [project(100, 50.0), project(200, 0.0), project(300, 10.0)])
    assert main(["simulate", "--trace", path, "--max-requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} line 2: arrives 50 s before" in err
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "keep the first N requests of the file, reading one line further" in help_text
    assert "by arrival" not in help_text
