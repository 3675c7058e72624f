"""`max_requests` N keeps the first N lines of a trace, the first N by arrival only in a file in
arrival order: the line after them is read and checked too, since one arriving before the N-th
is among the first N by arrival (it was left out silently); no line past it is read."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.trace_entry import TraceEntry
from vmemkv.scheduler.traces import load_trace


def write_arrivals(tmp_path, arrivals_s, tail=""):
    """A project JSONL trace, request i of prompt_len 100 * (i + 1) arriving at arrivals_s[i]."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 100 * (i + 1), "output_len": 5,
                                        "arrival_s": a}) + "\n"
                            for i, a in enumerate(arrivals_s)) + tail)
    return str(path)


def refusal(path, **kw):
    with pytest.raises(ConfigError) as refused:
        load_trace(path, **kw)
    return str(refused.value)


def test_the_line_after_the_nth_arriving_before_it_is_refused_naming_file_line_and_flag(
        tmp_path):
    # line 4 (prompt 400, 0.5 s) is the 2nd by arrival: it was left out, [100, 200, 300] kept
    path = write_arrivals(tmp_path, [0.0, 1.0, 2.0, 0.5])
    assert [e.prompt_len for e in load_trace(path)][:3] == [100, 400, 200]
    assert refusal(path, max_requests=3) == (
        f"{path} line 4: arrives 1.5 s before the line above it ({path} line 3), the last of "
        f"the 3 that max_requests (--max-requests) 3 keeps: it is among the first 3 by arrival "
        f"and would be left out, and finding them in a trace not in arrival order takes "
        f"reading all of it; max_requests (--max-requests) keeps the first N lines, the first "
        f"N by arrival only in a trace in arrival order: sort the file by arrival, or read it "
        f"all (no max_requests)")


def test_an_azure_row_after_the_nth_stamped_before_it_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.0000000,100,5\n"
                    "2023-11-16 18:15:47.0000000,200,5\n"
                    "2023-11-16 18:15:46.2500000,300,5\n")
    assert refusal(str(path), max_requests=2).startswith(
        f"{path} line 4: arrives 0.75 s before the line above it ({path} line 3), the last of "
        f"the 2 that max_requests (--max-requests) 2 keeps: ")
    assert load_trace(str(path), max_requests=1) == [TraceEntry(100, 5, 0.0)]
    assert load_trace(str(path)) == [TraceEntry(100, 5, 0.0), TraceEntry(300, 5, 0.25),
                                     TraceEntry(200, 5, 1.0)]


@pytest.mark.parametrize("next_arrival_s", [2.0, 7.5])
def test_the_line_after_the_nth_arriving_with_or_after_it_ends_the_reading(tmp_path,
                                                                          next_arrival_s):
    # a tie keeps file order (stable), so line 4 is not among the first 3 either way; the
    # line after it is not read (not JSON, and arriving before everything)
    path = write_arrivals(tmp_path, [0.0, 1.0, 2.0, next_arrival_s], tail="not json\n")
    assert [(e.prompt_len, e.arrival_s) for e in load_trace(path, max_requests=3)] == [
        (100, 0.0), (200, 1.0), (300, 2.0)]


def test_max_requests_at_or_past_the_file_length_keeps_every_line(tmp_path):
    path = write_arrivals(tmp_path, [0.0, 1.0, 2.0])
    assert [e.prompt_len for e in load_trace(path, max_requests=3)] == [100, 200, 300]
    assert [e.prompt_len for e in load_trace(path, max_requests=9)] == [100, 200, 300]


def test_simulate_refuses_it_in_one_line_exit_2(tmp_path, capsys):
    path = write_arrivals(tmp_path, [0.0, 10.0, 4.0])
    assert main(["simulate", "--trace", path, "--max-requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{path} line 3: arrives 6 s before the line above it ({path} line 2), the last " \
           f"of the 2 that max_requests (--max-requests) 2 keeps" in err
