"""``fidelity --refit FILE`` and ``calibration_stability --from FILE`` given a JSON file of
another kind say so, naming the flag and the file (exit 2): they ended in ``KeyError: 'argv'``
and ``KeyError: 'points'``, which named neither."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, flag, words", [
    ("fidelity", "--refit", "not this benchmark's --json (no argv and rounds)"),
    ("calibration_stability", "--from", "neither a device profile (vmemkv calibrate --out) nor "
                                        "this benchmark's --json"),
])
def test_a_saved_file_of_another_kind_is_named_as_such(tmp_path, module, flag, words):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"points": [], "coefficients": {}}))
    run = subprocess.run([sys.executable, "-m", f"vmemkv.benchmarks.{module}", flag, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"{flag} {path}: {words}" in run.stderr and "KeyError" not in run.stderr
    assert run.stderr.count("\n") == 1
