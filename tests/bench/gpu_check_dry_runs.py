"""The three dry runs of benchmarks/gpu_check.sh that test_gpu_check_script.py checks, started in
the background as soon as the session knows it will run those tests (tests/conftest.py).

They are subprocesses and take about 45-55 s of CPU (2026-12-07, down from 70-85 s: the script's
dry-run economies, a 1 s partial bench, one GPU-test pytest for the two partial runs, not two),
most of it Python start-ups importing torch.
A serial suite runs on one core (tests/conftest.py sets one torch thread), so on two cores the
runs overlap the rest of the suite instead of adding to it (under pytest-xdist, see
``run_order``): they run one after another (one
core, so they do not slow the suite's own subprocess tests by more than one process's share), at
a lower priority, beside the single-process tests: tests/distributed, whose ranks would share the
cores with them, and then the tests that read them run last (``run_order``).

Guarantees: ``results()`` returns each run's (returncode, stdout, out dir) once all three ended;
``stop()`` kills whatever is still running (each run is its own session, and every process in it
is killed: the steps' ``timeout`` puts their commands in process groups of their own) and removes
the output folders.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.sh")
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
TEST_FILE = "tests/bench/test_gpu_check_script.py"
NICENESS = 5         # below the suite's own processes: the runs fill its idle core
RUN_TIMEOUT_S = 600
# the partial run's bench step limit: its bench is held (VMEMKV_TEST_HOLD, 120 s) behind imports
# that take longer than this alone, so it is always still running at the limit (exit 124); 1 s
# spends about 1 s of CPU in it where 5 s spent the ~2.5 s of imports up to the hold
PARTIAL_BENCH_TIMEOUT_S = 1


def run_envs() -> dict:
    """{name: the environment variables each dry run adds to DRY_RUN=1}."""
    partial_python = {} if VENV_PYTHON.exists() else {"PYTHON": sys.executable}
    quick = dict(GPU_TESTS="tests/vmem/test_errors.py", BENCH_ONLY="memory", SKIP_ATTENTION="1")
    return {
        "whole": dict(PYTHON=sys.executable),
        # env, smoke, info, the gate and profile are the whole run's: here only the steps these
        # runs check, plus gpu_vmem and attention, which their selections must keep out
        # (GPU_TESTS gpu_vmem in require_gpu's, SKIP_ATTENTION attention in partial's). The GPU
        # tests run only in require_gpu, whose gate needs them; with the same GPU_TESTS there, a
        # pytest in partial too (~2 s of CPU) would check nothing more
        "partial": dict(BENCH_TIMEOUT=str(PARTIAL_BENCH_TIMEOUT_S), VMEMKV_TEST_HOLD="bench:memory",
                        STEPS="bench attention", **quick, **partial_python),
        "require_gpu": dict(REQUIRE_GPU="1", PYTHON=sys.executable,
                            STEPS="gpu_tests gpu_vmem gpu_gate", **quick),
    }


def _kill_session(sid: int) -> None:
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == sid:
                os.kill(int(entry), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def start_if_selected(session) -> None:
    """At the end of collection: start the runs when test_gpu_check_script.py is selected. Not
    in a pytest-xdist worker: every worker collects every test, so each would start them; the
    worker given the file starts them when its first test asks (test_gpu_check_script.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not session.config.option.collectonly and any(is_dry_run_test(item) for item in session.items):
        session.config.stash[DRY_RUNS_KEY] = DryRuns()


def is_dry_run_test(item) -> bool:
    return Path(item.path) == ROOT / TEST_FILE


def run_order(item) -> int:
    """Sort key: the suite's single-process tests first (the dry runs fill the idle core beside
    them), then tests/distributed (each starts ranks of its own: beside the runs they lost 14 s
    to sharing the cores), then the tests that read the runs. Under pytest-xdist the tests that
    read the runs come first: the worker given them starts the runs and waits on one core while
    the other worker goes on, as the serial suite's runs fill its idle core."""
    if is_dry_run_test(item):
        return -1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    return 1 if ROOT / "tests" / "distributed" in Path(item.path).parents else 0


def stop(config) -> None:
    runs = config.stash.get(DRY_RUNS_KEY, None)
    if runs is not None:
        runs.stop()


class DryRuns:
    """The three runs, one after another on a background thread."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gpu_check_dry_runs_"))
        self._results: dict = {}
        self._proc = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run_all, name="gpu-check-dry-runs", daemon=True)
        self._thread.start()

    def _run_all(self) -> None:
        base = {k: v for k, v in os.environ.items()
                if k not in ("PYTHON", "VMEMKV_TEST_HOLD", "REQUIRE_GPU", "GPU_TESTS", "STEPS")}
        for name, extra in run_envs().items():
            out = self.root / name
            out.mkdir()
            with self._lock:
                if self._stopped:
                    return
                self._proc = subprocess.Popen(
                    ["nice", "-n", str(NICENESS), "bash", SCRIPT, str(out)],
                    env=dict(base, DRY_RUN="1", **extra), text=True, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                stdout, _ = self._proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_session(self._proc.pid)
                stdout, _ = self._proc.communicate()
            self._results[name] = (self._proc.returncode, stdout, out)

    def results(self) -> dict:
        """{"whole", "partial", "require_gpu"}: each (returncode, stdout, out dir)."""
        self._thread.join(3 * RUN_TIMEOUT_S)
        return dict(self._results)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._proc is not None:
                _kill_session(self._proc.pid)
        self._thread.join(60)
        shutil.rmtree(self.root, ignore_errors=True)


DRY_RUNS_KEY = pytest.StashKey[DryRuns]()
