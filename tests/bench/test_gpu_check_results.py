"""benchmarks/gpu_check.py: per-test results written as they happen, a hung test ended by the
per-test timeout and named, and the gate's verdicts on each kind of result."""
import json
import os
import subprocess
import sys
import textwrap

from vmemkv.benchmarks.gpu_check import gate_problems, read_results


def _pytest(tmp_path, body: str, timeout_s: str = "0"):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, GPU_CHECK_RESULTS=str(tmp_path / "gpu_tests.jsonl"),
               GPU_CHECK_TEST_TIMEOUT=timeout_s)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "vmemkv.benchmarks.gpu_check", str(tmp_path / "test_sample.py")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_each_outcome_and_skip_reason_is_recorded(tmp_path):
    _pytest(tmp_path, """
        import pytest
        def test_ok(): pass
        def test_bad(): assert 1 == 2
        @pytest.mark.skip(reason="GPU test: no CUDA GPU")
        def test_skipped(): pass
    """)
    results = {t.split("::")[1]: r for t, r in read_results(tmp_path).items()}
    assert results["test_ok"] == ("passed", "")
    assert results["test_bad"][0] == "failed"
    assert results["test_skipped"] == ("skipped", "GPU test: no CUDA GPU")


def test_a_hung_test_is_ended_and_named_and_earlier_results_kept(tmp_path):
    done = _pytest(tmp_path, """
        import time
        def test_first(): pass
        def test_hangs(): time.sleep(60)
        def test_never_reached(): pass
    """, timeout_s="1")
    assert done.returncode != 0 and "test_hangs" in done.stderr     # faulthandler's traceback
    results = {t.split("::")[1]: r[0] for t, r in read_results(tmp_path).items()}
    assert results == {"test_first": "passed", "test_hangs": "died"}
    assert any("died" in p for p in gate_problems(read_results(tmp_path), "gpu"))


def test_the_gate_requires_a_pass_and_no_skip_for_a_missing_gpu():
    passed = {"t::a": ("passed", "")}
    assert gate_problems(passed, "gpu") == []
    assert gate_problems({**passed, "t::b": ("skipped", "needs flash_attn 2.6")}, "gpu") == []
    assert gate_problems({**passed, "t::c": ("skipped", "no CUDA")}, "gpu") == [
        "skipped for a missing GPU or binding: no CUDA"]
    assert gate_problems({"t::b": ("skipped", "needs 2 GPUs? no: slow")}, "gpu")  # nothing passed
    # a test's own reason that names GPUs is not a missing GPU; conftest's marker is
    assert gate_problems({**passed, "t::e": ("skipped", "needs 2 GPUs, 1 visible")}, "gpu") == []
    assert gate_problems({**passed, "t::f": ("skipped", "GPU test: torch has no CUDA build")},
                         "gpu") == ["skipped for a missing GPU or binding: GPU test: torch has no CUDA build"]
    assert gate_problems({}, "gpu") and gate_problems({}, "skip")
    assert gate_problems({**passed, "t::d": ("failed", "boom")}, "gpu") == ["t::d: failed boom"]
    assert gate_problems({"t::c": ("skipped", "no CUDA")}, "skip") == []
    assert gate_problems(passed, "skip") == ["dry run: 1 GPU tests did not skip"]


def test_a_line_cut_short_by_a_kill_is_ignored(tmp_path):
    lines = [json.dumps({"test": "t::a", "outcome": "start"}),
             json.dumps({"test": "t::a", "outcome": "passed", "when": "call", "reason": ""}),
             '{"test": "t::b", "outc']
    (tmp_path / "gpu_tests.jsonl").write_text("\n".join(lines))
    assert read_results(tmp_path) == {"t::a": ("passed", "")}


def test_versions_name_each_package_even_one_without_a_version_attribute():
    """pytest_timeout has no __version__: the digest printed '?' for it; its distribution's
    version is what was installed."""
    from importlib.metadata import version

    from vmemkv.benchmarks.gpu_check import VERSIONED, versions
    found = versions()
    assert set(VERSIONED) <= set(found)
    assert found["pytest_timeout"] == version("pytest-timeout")
    assert found["pytest"] == version("pytest") and found["flash_attn"].startswith("missing: ")
