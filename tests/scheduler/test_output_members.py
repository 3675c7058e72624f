"""--out DIR: every file a run writes there is checked before its work (result_files.
folder_problem), not only DIR/STALE.txt: a folder at DIR/sweep.csv or DIR/bench.json was found
by os.replace after every point or section had run (IsADirectoryError)."""
import argparse
import os

import pytest

from vmemkv.benchmarks.suite import OUTPUTS as BENCH_OUTPUTS
from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.result_files import StaleMarker, folder_problem
from vmemkv.scheduler.sweep_journal import RowJournal

SPEC = '[base]\nrequests = 50\nmodel = "tiny"\n[grid]\npolicy = ["vmem", "paged"]\n'


@pytest.mark.parametrize("member", ["sweep.csv", "sweep.rows.jsonl", "throughput_latency.png"])
def test_sweep_refuses_a_folder_at_an_output_name_before_any_point_runs(tmp_path, capsys, member):
    (tmp_path / "spec.toml").write_text(SPEC)
    out = tmp_path / "s1"
    (out / member).mkdir(parents=True)
    (out / "sweep.parquet").write_text("an earlier run's")
    code = main(["sweep", str(tmp_path / "spec.toml"), "--out", str(out), "--no-progress",
                 "--jobs", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{out}: {out / member} is not a regular file" in err and "another folder" in err
    # checked before the folder is touched (the journal's name too: it was found after
    # STALE.txt had named sweep.parquet stale)
    assert sorted(os.listdir(out)) == sorted([member, "sweep.parquet"])
    assert os.listdir(out / member) == []


def test_bench_refuses_a_folder_at_bench_json_before_any_section(tmp_path):
    (tmp_path / "bench.json").mkdir()
    with pytest.raises(ConfigError, match="bench.json is not a regular file"):
        StaleMarker(str(tmp_path), BENCH_OUTPUTS, "vmemkv bench").begin()
    assert os.listdir(tmp_path) == ["bench.json"]


def test_bench_out_is_checked_with_the_suites_names_before_anything(tmp_path):
    from vmemkv.bench import _check_out_and_tp
    from vmemkv.cli import UsageError
    (tmp_path / "prefix.json").mkdir()
    with pytest.raises(UsageError, match=r"--out .*prefix.json is not a regular file"):
        _check_out_and_tp(argparse.Namespace(suite_out=str(tmp_path), tp=None))
    assert os.listdir(tmp_path) == ["prefix.json"]


def test_output_files_that_are_files_or_absent_pass(tmp_path):
    (tmp_path / "sweep.csv").write_text("old")
    os.symlink(tmp_path / "sweep.csv", tmp_path / "a.png")   # a link to a file: written through
    assert folder_problem(str(tmp_path), ["sweep.csv", "sweep.parquet", "*.png"]) is None
    os.symlink("/nonexistent/b.png", tmp_path / "b.png")
    assert ("b.png is a link to /nonexistent/b.png, whose folder /nonexistent does not exist"
            in folder_problem(str(tmp_path), ["*.png"]))
    with pytest.raises(ConfigError, match="sweep.rows.jsonl is not a regular file"):
        (tmp_path / "sweep.rows.jsonl").mkdir()
        RowJournal(str(tmp_path), [], resume=False)
