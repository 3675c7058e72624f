"""benchmarks/gpu_check.sh, dry run on the CPU: every step but the CUDA calls, at toy sizes.

GPU time is scarce, so the script must work the first time it meets a GPU, and must never
report OK for a run that tested nothing. Three dry runs check its plumbing (gpu_check_dry_runs.py
runs them in the background while the rest of the suite runs; these tests run last):
- the whole script (env, smoke, info, three GPU-test groups, the gate, profile, `bench --smoke`,
  the attention grid at toy sizes): every step exits 0, every GPU test is collected and skips
  cleanly, at most 8 plain files land in the output folder, the step timeouts sum under 420 s;
- a partial rerun (BENCH_ONLY, SKIP_ATTENTION, STEPS) whose bench is held by the
  VMEMKV_TEST_HOLD hook until BENCH_TIMEOUT: the timeout is reported and fails the run;
- REQUIRE_GPU=1 (GPU_TESTS, STEPS: only the GPU tests and the gate): the GPU tests skip as they
  must on a CPU, and the gate makes that FAILED.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vmemkv.benchmarks.gpu_check import gate_problems, read_results

from .gpu_check_dry_runs import DRY_RUNS_KEY, PARTIAL_BENCH_TIMEOUT_S, VENV_PYTHON, DryRuns


@pytest.fixture(scope="module")
def dry_runs(request):
    """{"whole", "partial", "require_gpu"}: each (returncode, stdout, out dir); the runs were
    started at the end of collection (tests/conftest.py) when this module was selected."""
    runs = request.config.stash.get(DRY_RUNS_KEY, None)
    if runs is None:
        runs = request.config.stash[DRY_RUNS_KEY] = DryRuns()
    return runs.results()


def _steps(out: Path) -> dict:
    return {line.split()[0]: int(line.split()[2])
            for line in (out / "summary.txt").read_text().splitlines() if " exit " in line}


def test_dry_run_passes_every_step(dry_runs):
    rc, stdout, out = dry_runs["whole"]
    assert rc == 0, stdout[-6000:]
    assert "gpu_check: OK (dry run on the CPU)" in stdout
    assert _steps(out) == {"env": 0, "smoke": 0, "info": 0, "gpu_vmem": 0, "gpu_runtime": 0,
                           "gpu_rest": 0, "gpu_gate": 0, "profile": 0, "bench": 0, "attention": 0,
                           "layouts": 0}


def test_outputs_are_at_most_eight_plain_files_straight_in_the_folder(dry_runs):
    _, _, out = dry_runs["whole"]
    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files) and len(files) <= 8
    assert set(files) == {"summary.txt", "steps.log", "gpu_tests.jsonl", "smoke.json",
                          "profile.json", "bench.json", "attention.json", "artifacts.tgz"}


def test_step_timeouts_sum_under_420_seconds(dry_runs):
    _, _, out = dry_runs["whole"]
    budget = [line for line in (out / "summary.txt").read_text().splitlines() if line.startswith("budget ")]
    assert budget and int(budget[0].split()[1]) < 420


def test_every_gpu_test_is_collected_and_skips_cleanly(dry_runs):
    _, _, out = dry_runs["whole"]
    results = read_results(out)
    assert len(results) >= 100                          # driver, cache and backend GPU tests
    assert {outcome for outcome, _ in results.values()} == {"skipped"}
    assert gate_problems(results, "skip") == []


def test_the_smoke_and_profile_steps_write_their_verdicts(dry_runs):
    _, _, out = dry_runs["whole"]
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["dry_run"] and set(smoke["verdicts"]) >= {"versions", "map_from_thread",
                                                           "unmap_after_kernel_per_plan"}
    assert all(smoke["verdicts"].values())
    versions = smoke["checks"]["versions"]
    assert {"torch", "cuda.bindings", "transformers"} <= set(versions)
    profile = json.loads((out / "profile.json").read_text())
    assert set(profile["checks"]) == {"vmem", "paged"}
    assert all(c["steps"] > 0 and c["layers"] > 1 for c in profile["checks"].values())


def test_the_suite_writes_its_json_and_plots(dry_runs):
    _, _, out = dry_runs["whole"]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["environment"]["device"] and set(payload["sections"]) >= {"alloc", "attention", "memory"}
    listing = subprocess.run(["tar", "tzf", str(out / "artifacts.tgz")], capture_output=True,
                             text=True, check=True).stdout.split()
    assert any(name.endswith(".png") for name in listing)
    assert {f"artifacts/{g}.xml" for g in ("gpu_vmem", "gpu_runtime", "gpu_rest")} <= set(listing)
    attention = json.loads((out / "attention.json").read_text())
    assert {r["cache"] for r in attention["results"]} == {"vmem", "paged"}
    steps_log = (out / "steps.log").read_text()
    assert '"host"' in steps_log and '"cuda"' in steps_log   # both drivers reported, with reasons


def test_the_digest_lists_counts_skip_reasons_and_versions(dry_runs):
    _, _, out = dry_runs["whole"]
    digest = (out / "summary.txt").read_text()
    assert "gpu tests: 0 passed, 0 failed, 0 error," in digest
    assert "skipped x" in digest and "no CUDA" in digest
    assert "bench sections:" in digest and "errors: none" in digest
    assert "attention backends:" in digest and "paged/vmem" in digest and "total " in digest
    # versions: the whole dry run's from its env step; a run without that step (STEPS) asks
    # Python at its end, as a real run's summary does
    for run in ("whole", "require_gpu"):
        summary = (dry_runs[run][2] / "summary.txt").read_text()
        assert "torch " in summary and "cuda.bindings " in summary and "transformers " in summary


def test_gpu_tests_that_skipped_for_a_missing_gpu_make_the_run_fail(dry_runs):
    rc, stdout, out = dry_runs["require_gpu"]
    assert rc == 1 and "gpu_check: FAILED (dry run on the CPU)" in stdout
    assert _steps(out)["gpu_gate"] == 1 and _steps(out)["gpu_tests"] == 0
    log = (out / "steps.log").read_text()
    assert "GATE: no GPU test passed" in log and "GATE: skipped for a missing GPU or binding" in log


def test_a_step_past_its_timeout_is_reported_and_fails_the_run(dry_runs):
    rc, stdout, out = dry_runs["partial"]
    assert rc == 1 and "gpu_check: FAILED (dry run on the CPU)" in stdout
    assert _steps(out)["bench"] == 124
    assert f"== bench: timed out after {PARTIAL_BENCH_TIMEOUT_S} s" in (out / "steps.log").read_text()


def test_partial_rerun_selections_reach_their_steps(dry_runs):
    # STEPS names attention (partial) and gpu_vmem (require_gpu) too: SKIP_ATTENTION and
    # GPU_TESTS keep them out; the GPU tests run in require_gpu's run, with the same GPU_TESTS
    _, _, out = dry_runs["partial"]
    assert set(_steps(out)) == {"bench"}
    bench_line = next(l for l in (out / "steps.log").read_text().splitlines() if l.startswith("== bench:"))
    assert "--only memory" in bench_line                                    # BENCH_ONLY
    _, _, out = dry_runs["require_gpu"]
    assert set(_steps(out)) == {"gpu_tests", "gpu_gate"}
    tests = read_results(out)
    assert tests and {t.split("::")[0] for t in tests} == {"tests/vmem/test_errors.py"}


def test_the_checkouts_venv_python_is_found_without_PYTHON(dry_runs):
    _, stdout, _ = dry_runs["partial"]
    expected = ".venv/bin/python" if VENV_PYTHON.exists() else sys.executable
    assert f"python {expected};" in stdout
