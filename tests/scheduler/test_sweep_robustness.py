"""`vmemkv sweep` keeps what finished: rows journaled as they finish, a failing point as a row
with its error, Ctrl-C (a real SIGINT) cancelling the pending points, --resume, and a grid
or a spec value refused before anything runs."""
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmemkv.cli import INTERRUPTED_EXIT, main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sweep import expand, load_spec

from ..signals import sigint_as_ctrl_c

BROKEN = f"{Path(__file__).parent / 'custom_policy.py'}:BrokenAboveOneGB"


def write(tmp_path, text: str, name: str = "spec.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def journal(out) -> list:
    path = out / "sweep.rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_failing_point_is_a_row_with_its_error_and_the_others_are_kept(tmp_path, capsys):
    spec = write(tmp_path, f'[base]\nrequests = 30\npolicy = "{BROKEN}"\n[grid]\n'
                           f'cache_gb = [1, 2, 0.5]\n')
    out = tmp_path / "out"
    assert main(["sweep", spec, "--out", str(out), "--jobs", "1", "--no-progress",
                 "--no-plots"]) == 1
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["cache_gb"] for r in rows] == ["1", "2", "0.5"]              # grid order
    assert rows[1]["error"].startswith("PolicyError: ") and "BrokenAboveOneGB.__init__ raised " \
        "RuntimeError: no support for 2000000000 bytes" in rows[1]["error"]
    assert rows[0]["error"] == rows[2]["error"] == "" and float(rows[0]["p90_ttft_ms"]) > 0
    assert "1 of 3 points failed" in capsys.readouterr().err
    assert len(journal(out)) == 3


def test_resume_runs_only_the_points_the_journal_lacks(tmp_path, capsys):
    spec = write(tmp_path, f'[base]\nrequests = 30\npolicy = "{BROKEN}"\n[grid]\n'
                           f'cache_gb = [1, 2]\n')
    out = tmp_path / "out"
    main(["sweep", spec, "--out", str(out), "--jobs", "1", "--no-progress", "--no-plots"])
    first = journal(out)
    with open(out / "sweep.rows.jsonl", "a") as f:
        f.write('{"policy": "cut short by a ki')                       # a kill mid-line
    spec = write(tmp_path, f'[base]\nrequests = 30\npolicy = "{BROKEN}"\n[grid]\n'
                           f'cache_gb = [1, 2, 0.75]\n')
    capsys.readouterr()
    main(["sweep", spec, "--out", str(out), "--jobs", "1", "--no-progress", "--no-plots",
          "--resume"])
    rows = journal(out)
    assert rows[0] == first[0]                       # kept as it was, not run again
    assert [r["cache_gb"] for r in rows] == [1, 2, 0.75] and rows[1].get("error")   # reran 2
    assert "1 rows kept from the journal" in capsys.readouterr().out


def test_a_grid_over_max_points_is_refused_before_it_is_expanded(tmp_path, capsys):
    values = ", ".join(str(v) for v in range(2, 102))
    spec = write(tmp_path, "[grid]\n" + "".join(f"{k} = [{values}]\n" for k in
                                               ("requests", "seed", "max_len", "block_size", "max_running")))
    out = str(tmp_path / "o")
    assert main(["sweep", spec, "--out", out, "--max-points", "20000"]) == 2   # 10^10 points
    assert "10,000,000,000 points" in capsys.readouterr().err
    assert main(["sweep", spec, "--out", out]) == 2                            # the default
    assert "more than --max-points 10,000" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["sweep", spec, "--max-points", "0"])


@pytest.mark.parametrize("text,words", [
    ("[base]\ncache_gb = 1e308\n", "base.cache_gb must be a finite number > 0 and <= 1,000,000, got 1e+308"),
    ('[grid]\ncache_gb = [1, "two"]\n', "grid.cache_gb[1] must be a finite number"),
    ("[grid]\nrequests = [10.5]\n", "grid.requests[0] must be an int >= 1"),
    ("[base]\nwatermark = nan\n", "base.watermark must be a finite number >= 0 and <= 1, got nan"),
    ("[base]\nrequests = [1, 2]\n", "base.requests must be an int"),
    ("[base]\npolicy = 3\n", "base.policy must be a non-empty string"),
    ("[grid]\nseed = [true]\n", "grid.seed[0] must be an int"),
    ("", "the spec is empty"),
    ("[grid]\n", "the spec is empty"),
])
def test_a_spec_value_of_the_wrong_type_or_range_is_refused_naming_the_field(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace("+", r"\+").replace("(", r"\(")):
        expand(load_spec(write(tmp_path, text)))


def test_json_specs_nested_too_deeply_or_with_nan_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_spec(write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json"))
    with pytest.raises(ConfigError, match="base.cache_gb must be a finite number"):
        load_spec(write(tmp_path, '{"base": {"cache_gb": NaN}}', "nan.json"))
    with pytest.raises(ConfigError, match=r"\[base\] must be a table"):
        load_spec(write(tmp_path, '{"base": [1]}', "list.json"))


def test_ctrl_c_cancels_the_pending_points_and_writes_the_rows_that_finished(tmp_path):
    """A real SIGINT once the first (small) point is journaled: the workers running the big
    points (a minute each, about 2 GB: bigger ones are refused by the memory check) are ended at
    once, the table holds the finished row, exit 130."""
    spec = write(tmp_path, "[base]\nmax_len = 1024\n[grid]\n"
                           "requests = [20, 100000, 100001, 100002, 100003]\n")   # 2 GB each
    out = tmp_path / "out"
    out.mkdir()
    (out / "throughput_latency.png").write_text("an earlier run's plot")
    proc = subprocess.Popen([sys.executable, "-m", "vmemkv.cli", "sweep", spec, "--out", str(out),
                             "--jobs", "2", "--no-progress"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_ctrl_c)
    deadline = time.monotonic() + 120       # a bound on a hang, not a timing check
    while not journal(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=60)          # the big points would take minutes
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the sweep did not stop on Ctrl-C")
    err = proc.stderr.read()
    assert rc == INTERRUPTED_EXIT, err
    assert "interrupted; wrote 1 of 5 rows" in err and err.count("\n") == 1, err
    with open(out / "sweep.csv") as f:
        assert [r["requests"] for r in csv.DictReader(f)] == ["20"]
    assert (out / "STALE.txt").read_text().splitlines()[1:] == ["throughput_latency.png"]


def test_a_ctrl_c_while_a_row_is_being_journaled_keeps_that_row_in_the_table(tmp_path, monkeypatch, capsys):
    """The window a real SIGINT hit in a CI run: the journal line written (its fsync returning)
    and the KeyboardInterrupt raised before the row was counted. The table must hold every row
    the journal holds."""
    from vmemkv.scheduler.sweep_journal import RowJournal
    spec = write(tmp_path, "[base]\nmax_len = 1024\n[grid]\nrequests = [20, 21, 22]\n")
    out = tmp_path / "out"
    real_append = RowJournal.append

    def append_then_ctrl_c(self, row):
        real_append(self, row)
        raise KeyboardInterrupt   # as a signal delivered on fsync's return
    monkeypatch.setattr(RowJournal, "append", append_then_ctrl_c)
    assert main(["sweep", spec, "--out", str(out), "--jobs", "1", "--no-progress"]) == INTERRUPTED_EXIT
    assert "interrupted; wrote 1 of 3 rows" in capsys.readouterr().err
    with open(out / "sweep.csv") as f:
        assert [r["requests"] for r in csv.DictReader(f)] == [str(row["requests"]) for row in journal(out)]
