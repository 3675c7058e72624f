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

from ..signals import sigint_as_ctrl_c

MARKER = "vmemkv: holding at "


def start(hold: str, argv: list, cwd, stdin: str = "") -> subprocess.Popen:
    """``vmemkv ARGV`` in a subprocess that will wait at the hold point ``hold``."""
    env = dict(os.environ, VMEMKV_TEST_HOLD=hold, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "vmemkv.cli", *argv], cwd=cwd, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=sigint_as_ctrl_c)
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT):
    """Wait for the hold marker on stderr, send ``sig``; (rc, stdout, stderr after the marker)."""
    before = []
    for line in proc.stderr:            # blocks until the hold point is reached (or EOF)
        if line.startswith(MARKER):
            break
        before.append(line)
    else:
        proc.kill()
        return None, "", f"never reached the hold point: {''.join(before)[-2000:]}"
    proc.send_signal(sig)
    out, err = proc.stdout.read(), proc.stderr.read()
    return proc.wait(timeout=120), out, err


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The three subcommands started together (they spend most of their time importing torch),
    each interrupted at its hold point: {command: (rc, stdout, stderr, cwd)}. The bench folder
    holds an earlier run's files first."""
    cwd = tmp_path_factory.mktemp("interrupts")
    (cwd / "b").mkdir()
    for name in ("bench.json", "bench.log", "memory_utilisation.png"):
        (cwd / "b" / name).write_text(f"old {name}")
    procs = {   # bench --smoke: the memory section at toy sizes (40 requests), as quick's plumbing
        "bench": start("bench:engine", ["bench", "--smoke", "--only", "memory", "engine", "--out", "b",
                                        "--no-plots", "--no-progress"], cwd),
        "simulate": start("simulate", ["simulate", "--requests", "300", "--no-progress"], cwd),
        "generate": start("generate", ["generate", "--max-new-tokens", "3", "--no-progress"], cwd,
                          stdin="1 2 3\n4 5 6 7\n"),
    }
    return {name: (*interrupt(proc), cwd) for name, proc in procs.items()}


def assert_one_line(err: str, command: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"vmemkv {command}: interrupted; "), err
    return err


def test_interrupted_bench_writes_the_json_and_log_of_the_sections_that_finished(interrupted):
    rc, out, err, cwd = interrupted["bench"]
    assert rc == INTERRUPTED_EXIT, err
    assert "sections that finished: memory" in assert_one_line(err, "bench")
    payload = json.loads((cwd / "b" / "bench.json").read_text())
    assert payload["interrupted"] is True and payload["memory"]["results"]
    assert "engine" not in payload
    assert {row["section"] for row in payload["summary"]} == {"memory"}
    assert "== memory" in (cwd / "b" / "bench.log").read_text()
    assert not (cwd / "b" / "bench.log.partial").exists()
    # no plots drawn: the earlier run's PNG is still there, and named as stale
    assert (cwd / "b" / "STALE.txt").read_text().splitlines()[1:] == ["memory_utilisation.png"]


def test_interrupted_simulate_says_how_far_it_got_and_prints_no_result(interrupted):
    rc, out, err, _ = interrupted["simulate"]
    assert rc == INTERRUPTED_EXIT and out == "", err
    assert "of 300 requests had finished; no result written" in assert_one_line(err, "simulate")


def test_interrupted_generate_prints_the_samples_that_finished(interrupted):
    rc, out, err, _ = interrupted["generate"]
    assert rc == INTERRUPTED_EXIT, err
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
