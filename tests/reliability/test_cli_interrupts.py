"""Ctrl-C during `vmemkv bench`, `simulate` and `generate`: one line on stderr, exit status 130,
the memory released, and what had finished written (docs/errors.md, "Interrupts").

Each subprocess is held at a known point by the VMEMKV_TEST_HOLD hook (it prints a marker and
waits); SIGINT is sent only once the marker has been read, so no test depends on timing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from vmemkv.cli import INTERRUPTED_EXIT, main
from vmemkv.scheduler import cliargs

MARKER = "vmemkv: holding at "


def interrupt_at(hold: str, argv: list, cwd, stdin: str = ""):
    """Run ``vmemkv ARGV``, wait for the hold marker on stderr, send SIGINT; (rc, out, err
    after the marker)."""
    env = dict(os.environ, VMEMKV_TEST_HOLD=hold, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "vmemkv.cli", *argv], cwd=cwd, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(stdin)
    proc.stdin.close()
    before = []
    for line in proc.stderr:            # blocks until the hold point is reached (or EOF)
        if line.startswith(MARKER):
            break
        before.append(line)
    else:
        proc.kill()
        pytest.fail(f"never reached the hold point {hold!r}: {''.join(before)[-2000:]}")
    proc.send_signal(signal.SIGINT)
    out, err = proc.stdout.read(), proc.stderr.read()
    return proc.wait(timeout=120), out, err


def assert_one_line(err: str, command: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"vmemkv {command}: interrupted; "), err
    return err


def test_interrupted_bench_writes_the_json_and_log_of_the_sections_that_finished(tmp_path):
    rc, out, err = interrupt_at("bench:engine", ["bench", "--quick", "--only", "memory", "engine",
                                                 "--out", "b", "--no-plots", "--no-progress"], tmp_path)
    assert rc == INTERRUPTED_EXIT
    assert "sections that finished: memory" in assert_one_line(err, "bench")
    payload = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert payload["interrupted"] is True and payload["memory"]["results"]
    assert "engine" not in payload
    assert {row["section"] for row in payload["summary"]} == {"memory"}
    assert "== memory" in (tmp_path / "b" / "bench.log").read_text()


def test_interrupted_simulate_says_how_far_it_got_and_prints_no_result(tmp_path):
    rc, out, err = interrupt_at("simulate", ["simulate", "--requests", "300", "--no-progress"], tmp_path)
    assert rc == INTERRUPTED_EXIT and out == ""
    assert "of 300 requests had finished; no result written" in assert_one_line(err, "simulate")


def test_interrupted_generate_prints_the_samples_that_finished(tmp_path):
    rc, out, err = interrupt_at("generate", ["generate", "--max-new-tokens", "3", "--no-progress"],
                                tmp_path, stdin="1 2 3\n4 5 6 7\n")
    assert rc == INTERRUPTED_EXIT
    assert "printed the 1 of 2 samples that had finished" in assert_one_line(err, "generate")
    (line,) = out.splitlines()
    assert line.startswith("[prompt ") and len(line.split("] ")[1].split()) == 3


def _memfds() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:vmemkv")
               for fd in fds if os.path.exists(f"/proc/self/fd/{fd}"))


def test_interrupted_generate_releases_the_cache(monkeypatch, capsys):
    """In process, so the cache's page pool (a memfd) can be counted: the interrupt closes it."""
    import io

    def interrupt(name, timeout_s=0.0):
        assert _memfds() > baseline           # the engine's pool is open while it generates
        raise KeyboardInterrupt
    baseline = _memfds()
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n"))
    monkeypatch.setattr("vmemkv.runtime.generate_cli.hold_point", interrupt)
    assert main(["generate", "--max-new-tokens", "2", "--no-progress"]) == INTERRUPTED_EXIT
    assert _memfds() == baseline
    out, err = capsys.readouterr()
    assert out.startswith("[prompt 0 sample 0] ") and err.count("\n") == 1


def test_hold_point_is_a_no_op_unless_named(monkeypatch):
    monkeypatch.setenv(cliargs.HOLD_ENV, "elsewhere")
    cliargs.hold_point("generate", timeout_s=60)      # returns at once
