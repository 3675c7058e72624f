"""benchmarks/gpu_check.sh, dry run on the CPU: every step but the CUDA calls.

GPU time is scarce, so the script must work the first time it meets a GPU: here it runs whole
(environment, info, the GPU test selection, the quick suite) with DRY_RUN=1, every GPU test must
be collected and skip cleanly, and every output file the GPU run will be judged by must appear.
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_dry_run_passes_every_step(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK (dry run on the CPU)" in proc.stdout
    steps = {line.split()[0]: int(line.split()[2])
             for line in (out / "summary.txt").read_text().splitlines() if " exit " in line}
    assert steps == {"env": 0, "info": 0, "gpu_tests": 0, "gpu_tests_all_skipped": 0, "bench": 0,
                     "attention": 0}


def test_every_gpu_test_is_collected_and_skips_cleanly(dry_run):
    _, out = dry_run
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    collected, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    assert collected == skipped and collected >= 100   # driver, cache and backend GPU tests
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0


def test_the_suite_writes_its_json_and_plots(dry_run):
    _, out = dry_run
    payload = json.loads((out / "bench" / "bench.json").read_text())
    assert payload["environment"]["device"] and set(payload["sections"]) >= {"alloc", "attention", "memory"}
    assert sorted(p.name for p in (out / "bench").glob("*.png"))
    attention = json.loads((out / "attention.json").read_text())
    assert {r["cache"] for r in attention["results"]} == {"vmem", "paged"}
    for log in ("env", "info", "gpu_tests", "bench", "attention"):
        assert (out / f"{log}.log").stat().st_size > 0
    info = (out / "info.log").read_text()
    assert '"host"' in info and '"cuda"' in info   # both drivers reported, with reasons
