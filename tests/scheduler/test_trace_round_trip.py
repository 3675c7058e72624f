"""What write_trace (and ``simulate --write-trace``) writes, load_trace (``--trace``) reads back
as the same entries, whatever the name: ``.gz`` is gzip (it was plain JSONL, which the reader
then refused as 'not a whole gzip file'), and a name the reader would read as another format
(``.csv``: Azure's columns; a bundled trace's name) is refused before anything is written or
simulated."""
import gzip
import json
import os

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.traces import load_trace
from vmemkv.scheduler.workload import (LoraSpec, TraceEntry, WorkloadSpec, assign_adapters,
                                       generate, write_trace)

FAST = ["simulate", "--requests", "30", "--cache-gb", "4", "--no-progress", "--json"]


def entries():
    drawn = generate(WorkloadSpec(num_requests=20, arrival_rate=3.0, seed=4))
    drawn = assign_adapters(drawn, LoraSpec(3), get_model("llama-3-8b"))
    return drawn + [TraceEntry(1100, 7, 99.0, hash_ids=(5, 6, 7))]


@pytest.mark.parametrize("name", ["w.jsonl", "w.jsonl.gz", "w", "w.txt.gz", "w.CSV"])
def test_what_is_written_is_read_back_as_the_same_entries(tmp_path, name):
    path = str(tmp_path / name)
    write_trace(path, entries())
    assert load_trace(path) == entries()


def test_a_gz_name_is_gzip(tmp_path):
    path = str(tmp_path / "w.jsonl.gz")
    write_trace(path, entries())
    lines = gzip.decompress(open(path, "rb").read()).decode().splitlines()
    assert json.loads(lines[0])["prompt_len"] == entries()[0].prompt_len


@pytest.mark.parametrize("name, match", [
    ("w.csv", r"write_trace .*w.csv: a .csv trace is read as Azure's columns"),
    ("w.csv.gz", r"write_trace .*w.csv.gz: a .csv trace is read as Azure's columns"),
    ("azure-code", r"write_trace azure-code: --trace azure-code replays the bundled trace"),
])
def test_a_name_read_as_another_format_is_refused_and_nothing_written(tmp_path, name, match,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = name if "/" not in name and "." not in name else str(tmp_path / name)
    with pytest.raises(ConfigError, match=match):
        write_trace(path, entries())
    assert os.listdir(tmp_path) == []


def result_of(argv, capsys) -> dict:
    """A run's JSON result without what differs between equal runs (wall time, the flags)."""
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    return {k: v for k, v in result.items() if k not in ("wall_seconds", "config")}


def test_simulate_writes_a_gz_trace_that_replays_to_the_same_result(tmp_path, capsys):
    trace = str(tmp_path / "w.jsonl.gz")
    written = result_of(FAST + ["--write-trace", trace, "--arrival-rate", "2"], capsys)
    replayed = result_of(["simulate", "--trace", trace, "--cache-gb", "4", "--json",
                          "--no-progress"], capsys)
    assert written == replayed


@pytest.mark.parametrize("name", ["w.csv", "w.csv.gz"])
def test_simulate_refuses_a_csv_write_trace_before_simulating(tmp_path, capsys, name):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(FAST + ["--write-trace", str(tmp_path / name)]))
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"--write-trace {tmp_path / name}: a .csv trace is read as Azure's columns" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("seeds, count", [("0-2", 3), ("0,5", 2)])
def test_simulate_refuses_write_trace_with_several_seeds_before_running(tmp_path, capsys, seeds,
                                                                        count):
    # it wrote the first seed's workload only, silently, and simulated them all
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(FAST + ["--seeds", seeds, "--write-trace", str(tmp_path / "t")]))
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"--write-trace writes one workload and --seeds draws {count} " in err
    assert os.listdir(tmp_path) == []


def test_one_seed_of_seeds_is_written(tmp_path, capsys):
    trace = str(tmp_path / "t.jsonl")
    written = result_of(FAST + ["--seeds", "3", "--write-trace", trace], capsys)
    replayed = result_of(["simulate", "--trace", trace, "--cache-gb", "4", "--json",
                          "--no-progress"], capsys)
    assert written == replayed


@pytest.mark.parametrize("refused", [
    ["--policy", "vmem", "--page-bytes", "1"],   # the pool's tables past host memory
    ["--beam-width", "2000"],                    # a request past max_running
])
def test_a_refused_simulation_leaves_an_existing_write_trace_file_as_it_was(tmp_path, capsys,
                                                                            refused):
    path = tmp_path / "keep.jsonl"
    path.write_text("precious\n")
    assert main(["simulate", "--requests", "3", "--no-progress", "--write-trace", str(path)]
                + refused) == 2
    assert "error" in capsys.readouterr().err
    assert path.read_text() == "precious\n"
    assert main(FAST + ["--write-trace", str(path)]) == 0     # a run that passes writes it
    assert len(load_trace(str(path))) == 30
