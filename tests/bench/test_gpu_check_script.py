"""benchmarks/gpu_check.sh, dry run on the CPU: every step but the CUDA calls, at toy sizes.

GPU time is scarce, so the script must work the first time it meets a GPU. Two dry runs check
its plumbing (not performance), side by side:
- the whole script (environment, info, the GPU test selection, `bench --smoke`, the attention
  grid at toy head sizes): every step exits 0, every GPU test is collected and skips cleanly,
  and every output file the GPU run will be judged by appears, with the digest;
- a partial rerun (GPU_TESTS, BENCH_ONLY, SKIP_ATTENTION) whose bench is held by the
  VMEMKV_TEST_HOLD hook (so it can never finish) until BENCH_TIMEOUT: the timeout is reported
  and fails the run, the
  selections reach their steps, and the checkout's venv Python is found without PYTHON.
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.sh")
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def _start(out: Path, **extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VMEMKV_TEST_HOLD")}
    return subprocess.Popen(["bash", SCRIPT, str(out)], env=dict(env, DRY_RUN="1", **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """(whole run, partial run): each (returncode, stdout, out dir); the two run concurrently."""
    whole, partial = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("gpu_check_partial")
    partial_python = {} if VENV_PYTHON.exists() else {"PYTHON": sys.executable}
    procs = [_start(whole, PYTHON=sys.executable),
             _start(partial, GPU_TESTS="tests/vmem/test_errors.py", BENCH_ONLY="memory",
                    SKIP_ATTENTION="1", BENCH_TIMEOUT="5", VMEMKV_TEST_HOLD="bench:memory",
                    **partial_python)]
    results = [(p.wait(timeout=600), p.stdout.read()) for p in procs]
    return (*results[0], whole), (*results[1], partial)


def _steps(out: Path) -> dict:
    return {line.split()[0]: int(line.split()[2])
            for line in (out / "summary.txt").read_text().splitlines() if " exit " in line}


def test_dry_run_passes_every_step(dry_runs):
    (rc, stdout, out), _ = dry_runs
    assert rc == 0, stdout[-6000:]
    assert "gpu_check: OK (dry run on the CPU)" in stdout
    assert _steps(out) == {"env": 0, "info": 0, "gpu_tests": 0, "gpu_tests_all_skipped": 0,
                           "bench": 0, "attention": 0}


def test_every_gpu_test_is_collected_and_skips_cleanly(dry_runs):
    (_, _, out), _ = dry_runs
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    collected, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    assert collected == skipped and collected >= 100   # driver, cache and backend GPU tests
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0


def test_the_suite_writes_its_json_and_plots(dry_runs):
    (_, _, out), _ = dry_runs
    payload = json.loads((out / "bench" / "bench.json").read_text())
    assert payload["environment"]["device"] and set(payload["sections"]) >= {"alloc", "attention", "memory"}
    assert sorted(p.name for p in (out / "bench").glob("*.png"))
    attention = json.loads((out / "attention.json").read_text())
    assert {r["cache"] for r in attention["results"]} == {"vmem", "paged"}
    for log in ("env", "info", "gpu_tests", "bench", "attention"):
        assert (out / f"{log}.log").stat().st_size > 0
    info = (out / "info.log").read_text()
    assert '"host"' in info and '"cuda"' in info   # both drivers reported, with reasons


def test_the_digest_summarises_tests_and_attention(dry_runs):
    (_, _, out), _ = dry_runs
    digest = (out / "summary.txt").read_text()
    assert "gpu tests: 0 passed, 0 failed, 0 errors," in digest
    assert "attention backends:" in digest and "paged/vmem" in digest and "total " in digest


def test_a_step_past_its_timeout_is_reported_and_fails_the_run(dry_runs):
    _, (rc, stdout, out) = dry_runs
    assert rc == 1 and "gpu_check: FAILED (dry run on the CPU)" in stdout
    assert _steps(out)["bench"] == 124
    bench_log = (out / "bench.log").read_text()
    assert "== bench: timed out after 5 s" in bench_log   # held (never finishes) or still starting


def test_partial_rerun_selections_reach_their_steps(dry_runs):
    _, (_, stdout, out) = dry_runs
    assert "attention" not in _steps(out)                                  # SKIP_ATTENTION
    assert "--only memory" in (out / "bench.log").read_text().splitlines()[0]   # BENCH_ONLY
    cases = list(ET.parse(out / "gpu_tests.xml").getroot().iter("testcase"))  # GPU_TESTS
    assert cases and {c.get("classname") for c in cases} == {"tests.vmem.test_errors"}


def test_the_checkouts_venv_python_is_found_without_PYTHON(dry_runs):
    _, (_, stdout, _) = dry_runs
    expected = ".venv/bin/python" if VENV_PYTHON.exists() else sys.executable
    assert f"python {expected};" in stdout
