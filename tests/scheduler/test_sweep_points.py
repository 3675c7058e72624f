"""`vmemkv sweep`'s points are what they run: a trace point is keyed by its file's contents (a
resume reruns a changed trace), every point is checked as `simulate` checks it before any runs
(its memory manager too), `layout = "auto"` resolves as the simulation resolves it, a value a
grid list repeats or a key in both tables is refused, and a refused run leaves `--out` as it
was."""
import hashlib
import json
import os
import sys

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import SimConfig
from vmemkv.scheduler.sweep import expand, load_spec, point_key, run_local
from vmemkv.scheduler.workload import TraceEntry, write_trace

SWEEP = ["--jobs", "1", "--no-plots", "--no-progress"]


def write(tmp_path, text: str, name: str = "spec.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def journal(out) -> list:
    with open(os.path.join(out, "sweep.rows.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_reruns_the_points_of_a_trace_whose_contents_changed(tmp_path, capsys):
    trace = str(tmp_path / "t.jsonl")
    write_trace(trace, [TraceEntry(40, 10, 0.1 * i) for i in range(8)])
    spec = write(tmp_path, f'[base]\ntrace = "{trace}"\ncache_gb = 2\n[grid]\npolicy = ["paged"]\n')
    out = str(tmp_path / "out")
    assert main(["sweep", spec, "--out", out] + SWEEP) == 0
    assert journal(out)[0]["output_tokens"] == 80
    write_trace(trace, [TraceEntry(40, 30, 0.1 * i) for i in range(8)])   # same path, new work
    assert main(["sweep", spec, "--out", out, "--resume"] + SWEEP) == 0
    (row,) = journal(out)
    assert row["output_tokens"] == 240                     # was 80: the old file's row was kept
    with open(trace, "rb") as f:
        assert row["trace_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert row["trace_path"] == os.path.realpath(trace)
    assert "kept from the journal" not in capsys.readouterr().out


def test_a_trace_point_is_keyed_by_the_resolved_file_not_the_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_trace("t.jsonl", [TraceEntry(40, 10, 0.0)])
    (point,) = expand({"base": {"trace": "t.jsonl"}, "grid": {}})
    assert point["trace_path"] == os.path.realpath("t.jsonl")
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")          # the same string names another file here
    write_trace("t.jsonl", [TraceEntry(40, 10, 0.0)])
    (moved,) = expand({"base": {"trace": "t.jsonl"}, "grid": {}})
    assert point_key(moved) != point_key(point)
    with pytest.raises(ConfigError, match=r"base.trace: cannot read trace 'gone.jsonl'"):
        expand({"base": {"trace": "gone.jsonl"}, "grid": {}})


def test_layout_auto_resolves_as_the_simulation_does_and_every_point_runs():
    points = expand({"base": {"policy": "vmem", "requests": 10, "cache_gb": 2},
                     "grid": {"layout": ["auto", "per-layer"]}})
    rows = run_local(points, jobs=1)
    assert [r.get("error") for r in rows] == [None, None]      # auto failed after simulating
    simulated = SimConfig(policy="vmem", layout="auto", cache_bytes=2 * 10**9)
    assert simulated.resolved_layout == "interleaved"   # llama-3-8b, 2 MiB: per-layer is 1,024
    assert [r["unit_tokens"] for r in rows] == [simulated.make_manager().tokens_per_page, 1024]
    assert rows[0]["unit_tokens"] < 1024


@pytest.mark.parametrize("base, grid, words", [
    ('policy = "paged"', "cache_gb = [4, 0.0001]",
     ["point cache_gb = 0.0001", "cache_bytes=100000 holds no block of 16 tokens"]),
    ('policy = "vmem"\ncache_gb = 4', 'page_bytes = ["2MiB", "1KiB"]',
     ["point page_bytes = '1KiB'", "page_bytes=1024 holds no token in the per-layer layout"]),
])
def test_a_point_simulate_refuses_is_refused_before_any_point_runs(tmp_path, capsys, base, grid,
                                                                   words):
    spec = write(tmp_path, f"[base]\nrequests = 10\n{base}\n[grid]\n{grid}\n")
    with pytest.raises(ConfigError) as error:
        expand(load_spec(spec))
    for word in words:
        assert word in str(error.value), (word, str(error.value))
    out = tmp_path / "out"
    assert main(["sweep", spec, "--out", str(out)] + SWEEP) == 2
    assert not out.exists()                  # nothing ran: no row, no table, no folder


@pytest.mark.parametrize("grid, words", [
    ('cache_gb = [4, 4.0]', "grid.cache_gb[1] 4.0 repeats grid.cache_gb[0] 4"),
    ('page_bytes = ["2MiB", 2097152]',
     "grid.page_bytes[1] 2097152 repeats grid.page_bytes[0] '2MiB'"),
])
def test_a_value_a_grid_list_repeats_is_refused_naming_it(tmp_path, grid, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_spec(write(tmp_path, f"[base]\npolicy = 'vmem'\n[grid]\n{grid}\n"))


def test_an_int_and_a_float_of_one_value_are_one_point():
    (four,) = expand({"base": {"cache_gb": 4}, "grid": {}})
    (four_f,) = expand({"base": {"cache_gb": 4.0}, "grid": {}})
    assert point_key(four) == point_key(four_f)       # a resume matches either row


def test_a_key_in_both_base_and_grid_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"policy is in both \[base\] and \[grid\]: .*"
                                          r"replace base.policy = 'paged'"):
        load_spec(write(tmp_path, '[base]\npolicy = "paged"\n[grid]\npolicy = ["vmem"]\n'))


def test_out_naming_a_file_is_one_line_naming_out(tmp_path, capsys):
    spec = write(tmp_path, "[base]\nrequests = 10\ncache_gb = 2\n[grid]\npolicy = ['paged']\n")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["sweep", spec, "--out", str(afile)] + SWEEP) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {afile} is not a folder" in err, err
    assert "FileExistsError" not in err and afile.read_text() == "mine"


def test_an_empty_out_is_one_line_naming_out(tmp_path, capsys, monkeypatch):
    spec = write(tmp_path, "[base]\nrequests = 10\ncache_gb = 2\n[grid]\npolicy = ['paged']\n")
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", spec, "--out", ""] + SWEEP) == 2
    err = capsys.readouterr().err
    assert err == "vmemkv sweep: error: ConfigError: --out needs a folder name, got ''\n", err
    assert os.listdir(tmp_path) == ["spec.toml"]     # nothing written, here or anywhere


def test_ray_missing_leaves_the_journal_and_files_of_the_last_run(tmp_path, monkeypatch, capsys):
    spec = write(tmp_path, "[base]\nrequests = 10\ncache_gb = 2\n[grid]\npolicy = ['paged']\n")
    out = tmp_path / "out"
    assert main(["sweep", spec, "--out", str(out)] + SWEEP) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    monkeypatch.setitem(sys.modules, "ray", None)       # import ray -> ImportError
    assert main(["sweep", spec, "--out", str(out), "--ray", "auto", "--no-progress"]) == 2
    assert "--ray needs Ray" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before   # no STALE.txt
