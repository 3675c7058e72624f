"""scheduler/result_files.py: every result file is whole or not at all (real SIGKILLs
mid-write), and a run marks in STALE.txt what an earlier run left beside its files."""
import json
import os
import signal
import subprocess
import sys

import pytest

from vmemkv.scheduler.result_files import (STALE_NAME, StaleMarker, atomic_open, streamed_open,
                                           write_json)

HOLD = "vmemkv: holding at "
WRITER = """
import sys
from vmemkv.scheduler.result_files import streamed_open, write_json
with streamed_open(sys.argv[2]) as log:
    log.write("new log line\\n"); log.flush()
    write_json(sys.argv[1], {"run": "new", "rows": list(range(100000))})
"""


def killed_mid_write(tmp_path, hold: str):
    """A writer held at ``hold`` (after its temporary file is written, before it replaces the
    old file), then SIGKILLed; returns its folder."""
    env = dict(os.environ, VMEMKV_TEST_HOLD=hold)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "out.json"),
                             str(tmp_path / "run.log")], env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:     # blocks until the hold point (or EOF)
        if line.startswith(HOLD):
            break
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return tmp_path


def test_a_kill_mid_write_leaves_the_old_file_whole_and_the_log_partial(tmp_path):
    write_json(str(tmp_path / "out.json"), {"run": "old"})
    (tmp_path / "run.log").write_text("old log\n")
    killed_mid_write(tmp_path, "write:out.json")
    assert json.loads((tmp_path / "out.json").read_text()) == {"run": "old"}
    assert (tmp_path / "run.log").read_text() == "old log\n"
    assert (tmp_path / "run.log.partial").read_text() == "new log line\n"


def test_an_exception_or_interrupt_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "t.json"
    write_json(str(path), [1])
    for error in (ValueError, KeyboardInterrupt):
        with pytest.raises(error), atomic_open(str(path)) as f:
            f.write("[2, ")
            raise error()
    assert json.loads(path.read_text()) == [1] and os.listdir(tmp_path) == ["t.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())   # not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_interrupted_log_keeps_what_was_logged(tmp_path):
    with pytest.raises(KeyboardInterrupt), streamed_open(str(tmp_path / "a.log")) as log:
        log.write("section 1\n")
        raise KeyboardInterrupt
    assert (tmp_path / "a.log").read_text() == "section 1\n"
    assert not (tmp_path / "a.log.partial").exists()


def test_the_stale_marker_names_what_a_run_did_not_rewrite(tmp_path):
    for name in ("bench.json", "a.png", "b.png", "notes.txt"):
        (tmp_path / name).write_text("old")
    marker = StaleMarker(str(tmp_path), ("bench.json", "*.png"), "vmemkv bench").begin()
    listed = (tmp_path / STALE_NAME).read_text()
    assert "has not finished" in listed and {"bench.json", "a.png", "b.png"} <= set(listed.split())
    assert "notes.txt" not in listed                 # not a file the run owns
    marker.wrote(str(tmp_path / "bench.json"))
    marker.wrote(str(tmp_path / "a.png"))
    marker.finish("interrupted")
    assert (tmp_path / STALE_NAME).read_text().splitlines()[1:] == ["b.png"]
    again = StaleMarker(str(tmp_path), ("bench.json", "*.png"), "vmemkv bench").begin()
    for name in ("bench.json", "a.png", "b.png"):
        again.wrote(str(tmp_path / name))
    again.finish()
    assert not (tmp_path / STALE_NAME).exists()
