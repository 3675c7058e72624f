"""A run killed between a result's write and its os.replace leaves '.NAME.XXXXXXXX.tmp' (a
kill -9 skips the clean-up); the next run in that folder removes those of the names it owns
(they stayed in --out for ever), and nothing else."""
import os
import signal
import subprocess
import sys

from vmemkv.scheduler.result_files import StaleMarker
from vmemkv.scheduler.sweep_journal import RowJournal

LONG = "b" * 250 + ".csv"


def test_the_next_run_removes_the_temporary_files_of_its_names_only(tmp_path):
    owned = [".sweep.parquet.z_5jkz23.tmp", ".throughput_latency.png.abcd1234.tmp",
             "." + "b" * 241 + ".q1w2e3r4.tmp"]                    # LONG's, cut to fit 255 bytes
    others = [".notmine.abcd1234.tmp", ".sweep.csv.short.tmp", "sweep.parquet.abcd1234.tmp",
              "keep.tmp", "sweep.parquet"]
    for name in owned + others:
        (tmp_path / name).write_text("x")
    StaleMarker(str(tmp_path), ("sweep.csv", "sweep.parquet", "*.png", LONG), "vmemkv sweep").begin()
    assert sorted(os.listdir(tmp_path)) == sorted(others + ["STALE.txt"])


def test_a_journal_rewrite_killed_before_its_replace_is_cleaned_by_the_next(tmp_path):
    env = dict(os.environ, VMEMKV_TEST_HOLD="write:sweep.rows.jsonl")
    code = ("import sys; from vmemkv.scheduler.sweep_journal import RowJournal; "
            "RowJournal(sys.argv[1], [], resume=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:                 # blocks until the hold point
        if line.startswith("vmemkv: holding at "):
            break
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert [n for n in os.listdir(tmp_path) if n.startswith(".sweep.rows.jsonl.")]
    RowJournal(str(tmp_path), [], resume=False).close()
    assert os.listdir(tmp_path) == ["sweep.rows.jsonl"]
