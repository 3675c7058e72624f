"""Every test of the suite runs under a time limit (pyproject.toml's pytest-timeout settings and
tests/hang_limit.py's backstop): a hung test ends as a failure that names it, with the stacks,
instead of stalling CI until its own limit. Before, the suite had no per-test limit at all.

Each case runs a small pytest session over a hanging test file with the suite's settings and a
0.5 s limit; the backstop then ends a hang inside C code 0.5 s later."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from .hang_limit import backstop_s
from .test_packaging import ROOT

LIMIT_S = "0.5"


def run_session(tmp_path, body: str) -> subprocess.CompletedProcess:
    """pytest -v over ``body`` with pyproject.toml's settings, the backstop plugin and a
    ``LIMIT_S`` limit, in a fresh process (a kill ends only it)."""
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-c", str(ROOT / "pyproject.toml"), "-p", "tests.hang_limit", "-o", f"timeout={LIMIT_S}",
         str(tmp_path / "test_hangs.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_suite_runs_every_test_under_the_limit_with_the_backstop(pytestconfig):
    assert pytestconfig.getini("timeout") == "300"
    assert pytestconfig.getini("timeout_method") == "signal"
    assert pytestconfig.pluginmanager.has_plugin("tests.hang_limit")
    assert backstop_s(300) == 330 and backstop_s(0.5) == 1.0


def test_a_test_waiting_on_a_silent_socket_fails_alone_and_the_session_goes_on(tmp_path):
    done = run_session(tmp_path, """
        import socket
        def test_first(): pass
        def test_waits_on_a_silent_socket():
            a, b = socket.socketpair()
            a.recv(1)                   # a server that never answers
        def test_after(): pass
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "::test_waits_on_a_silent_socket FAILED" in done.stdout
    assert f"Failed: Timeout (>{LIMIT_S}s) from pytest-timeout" in done.stdout
    assert "a.recv(1)" in done.stdout                     # where it waited
    assert "::test_after PASSED" in done.stdout
    assert "1 failed, 2 passed" in done.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="signal.sigwait is POSIX")
def test_a_test_hung_inside_c_code_ends_the_process_with_every_stack_naming_it(tmp_path):
    done = run_session(tmp_path, """
        import signal
        def test_first(): pass
        def test_hangs_in_c():
            signal.sigwait({signal.SIGUSR2})   # retries in C on SIGALRM, as a gloo wait does
        def test_never_reached(): pass
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "::test_first PASSED" in done.stdout
    assert "Timeout (0:00:01)!" in done.stderr                       # faulthandler at 1 s
    assert "in test_hangs_in_c" in done.stderr                       # the test's frame
    assert "test_never_reached" not in done.stdout
