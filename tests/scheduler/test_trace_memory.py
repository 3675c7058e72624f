"""A trace is read as a stream, what it may hold checked against available memory as it is read,
and reading stops at max_requests. load_trace read a file whole, gunzipped it whole and parsed
every line before max_requests was applied: a 6 MB gzip of newlines inflating to 6 GiB
committed 3.75 GB before a MemoryError. Available memory is faked here; the files are small."""
import gzip
import re

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import sim_memory, trace_stream
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sim_memory import ENTRY_BYTES, SimulationTooLargeError
from vmemkv.scheduler.traces import load_trace
from vmemkv.scheduler.workload import TraceEntry

LINE = b'{"prompt_len": 5, "output_len": 3, "arrival_s": 0}\n'
AVAILABLE_BYTES = 1 << 20
STEP_BYTES = 64 << 10
CHUNK_BYTES = 16 << 10


@pytest.fixture
def small_host(monkeypatch):
    """1 MiB available; reads of at most 16 KiB and checks 64 KiB ahead."""
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: AVAILABLE_BYTES)
    monkeypatch.setattr(trace_stream, "READ_CHUNK_BYTES", CHUNK_BYTES)
    monkeypatch.setattr(trace_stream, "CHECK_STEP_BYTES", STEP_BYTES)


def read_so_far(error) -> tuple:
    found = re.search(r"\(([\d,]+) lines and ([\d,]+) bytes of text read so far", str(error))
    return tuple(int(n.replace(",", "")) for n in found.groups())


def charge(lines: int, text_bytes: int) -> int:
    return lines * ENTRY_BYTES + text_bytes * trace_stream.TEXT_BYTE_CHARGE


def test_a_gzip_of_newlines_is_refused_after_reading_what_fits(tmp_path, small_host):
    path = tmp_path / "bomb.jsonl.gz"                   # 4 MiB of newlines in 4 KiB
    path.write_bytes(gzip.compress(b"\n" * (4 << 20), mtime=0))
    with pytest.raises(SimulationTooLargeError) as refused:
        load_trace(str(path))
    lines, text_bytes = read_so_far(refused.value)
    assert lines == text_bytes == CHUNK_BYTES           # one byte a line; the first chunk read
    assert charge(lines, text_bytes) + STEP_BYTES > AVAILABLE_BYTES     # 8.5 MB: refused
    message = str(refused.value)
    assert f"reading trace {path} (" in message and "MemAvailable of 1048576 bytes" in message
    assert "--max-requests" in message and isinstance(refused.value, ConfigError)


def test_a_line_with_no_end_is_read_in_pieces_and_refused(tmp_path, small_host):
    path = tmp_path / "one_line.jsonl.gz"
    path.write_bytes(gzip.compress(b"7" * (8 << 20), mtime=0))
    with pytest.raises(SimulationTooLargeError) as refused:
        load_trace(str(path))
    lines, text_bytes = read_so_far(refused.value)
    assert lines == 0 and text_bytes % CHUNK_BYTES == 0
    assert 4 * text_bytes + STEP_BYTES > AVAILABLE_BYTES >= 4 * text_bytes - STEP_BYTES


def test_a_last_line_with_no_newline_is_charged_as_a_line(tmp_path, monkeypatch):
    path = tmp_path / "one.jsonl"
    path.write_bytes(LINE.rstrip(b"\n"))
    monkeypatch.setattr(trace_stream, "CHECK_STEP_BYTES", 0)
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: charge(1, len(LINE) - 1) - 1)
    with pytest.raises(SimulationTooLargeError) as error:
        load_trace(str(path))
    assert read_so_far(error.value) == (1, len(LINE) - 1)


def test_memory_is_checked_a_step_ahead_of_the_charge(tmp_path, small_host):
    """1,400 lines are charged 1,008,000 bytes, under the 1 MiB available, but not with the
    64 KiB step more that each check asks for: refused, though what was read fits."""
    path = tmp_path / "near.jsonl"
    path.write_bytes(LINE * 1400)
    assert charge(1400, 1400 * len(LINE)) < AVAILABLE_BYTES < charge(1400, 1400 * len(LINE)) \
        + STEP_BYTES
    with pytest.raises(SimulationTooLargeError) as error:
        load_trace(str(path))
    lines, text_bytes = read_so_far(error.value)
    assert charge(lines, text_bytes) <= AVAILABLE_BYTES < charge(lines, text_bytes) + STEP_BYTES


def test_a_plain_file_of_requests_is_refused_and_max_requests_reads_only_its_lines(
        tmp_path, small_host):
    path = tmp_path / "many.jsonl"
    path.write_bytes(LINE * 5000 + b"not json\n")          # 5,000 lines: 2.8 MB charged
    with pytest.raises(SimulationTooLargeError):
        load_trace(str(path))
    # the first 10 requests: the lines after them (a bad one among them) are not read
    assert load_trace(str(path), max_requests=10) == [TraceEntry(5, 3, 0.0)] * 10


def test_max_requests_stops_reading_a_gzip_before_its_bad_tail(tmp_path, small_host):
    # chunks past the first three requests: a bad line, then a wrong CRC at the end
    path = tmp_path / "tail.jsonl.gz"
    text = LINE * 800 + b"[1, 2]\n"                     # 40 KB
    path.write_bytes(gzip.compress(text, mtime=0)[:-8] + b"\0" * 8)
    assert load_trace(str(path), max_requests=3) == [TraceEntry(5, 3, 0.0)] * 3
    with pytest.raises(ConfigError, match="not a whole gzip file"):
        load_trace(str(path))


@pytest.mark.parametrize("text, match", [
    # lines are numbered as str.splitlines numbers the whole text: a form feed ends one
    (LINE + b"\x0c[1]\n", r"line 3: "),
    (LINE + b"\r\n" + LINE.rstrip() + b"\rnot json\r\n", r"line 4: not JSON"),
])
def test_jsonl_lines_keep_their_numbers(tmp_path, text, match):
    path = tmp_path / "t.jsonl"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=match):
        load_trace(str(path))


def test_bundled_traces_cut_at_max_requests_are_the_whole_trace_cut():
    for name in ("azure-code", "mooncake-synthetic"):
        assert load_trace(name, max_requests=500) == load_trace(name)[:500]


def test_simulate_on_a_trace_too_big_is_one_line_exit_2(tmp_path, small_host, capsys):
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" * (4 << 20), mtime=0))
    assert main(["simulate", "--trace", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"SimulationTooLargeError: reading trace {path}" in err
