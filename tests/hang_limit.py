"""The suite's per-test time limit, for a test that hangs (a deadlocked collective, a server that
never answers): without one, CI stalls until its own limit and never names the test.

pyproject.toml sets pytest-timeout's ``timeout`` (300 s; no test takes 50 s) with the
``signal`` method: at the limit SIGALRM fails the test where it waits (a socket read, a sleep, a
lock, a subprocess: each returns to Python on the signal), with the other threads' stacks in its
report, and the session goes on; under pytest-xdist the worker lives on too. This plugin adds the
backstop for a wait that never returns to Python (C code that retries on the signal: a gloo
collective, a C++ store's wait), where the signal cannot act: ``settings.timeout`` plus a grace
(as long again, at most ``GRACE_S``) later, faulthandler writes every thread's stack to the real
stderr and ends the process. Under pytest-xdist that process is a worker, and the controller
reports "worker 'gwN' crashed while running '<test>'". xdist 3.8's loadfile scheduling then runs
that test again on the replacement worker (pytest-xdist pull request 1371), each time for another
limit, and can leave the session waiting on work it never sends (issue 1378): the stacks on
stderr, which name the test, come first either way.

It follows pytest-timeout's own per-test settings, so ``--timeout 0`` (or ``-o timeout=0``)
lifts both, ``--timeout 900`` raises both, and ``@pytest.mark.timeout(N)`` applies to both.
"""
from __future__ import annotations

import faulthandler
import os

import pytest

GRACE_S = 30.0

_real_stderr = None     # fd 2 before pytest captures it for each test (a kill must show its dump)


def pytest_configure(config):
    global _real_stderr
    if _real_stderr is None:
        _real_stderr = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config):
    global _real_stderr
    if _real_stderr is not None:
        _real_stderr.close()
        _real_stderr = None


def backstop_s(limit_s: float) -> float:
    """Seconds from a test's start to the process's end when the signal at ``limit_s`` could not
    end the test."""
    return limit_s + min(limit_s, GRACE_S)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    from pytest_timeout import is_debugging
    if settings.disable_debugger_detection or not is_debugging():   # pytest-timeout's rule
        faulthandler.dump_traceback_later(backstop_s(settings.timeout), exit=True, file=_real_stderr)
    # returns None: pytest-timeout's own timer (the signal) is armed next


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()
