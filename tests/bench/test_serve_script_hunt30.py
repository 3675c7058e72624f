"""``python -m vmemkv.benchmarks.serve`` runs ``vmemkv bench serve`` as every benchmark script
runs on its own (it had no ``__main__``: any flags, or none, did nothing and exited 0)."""
from __future__ import annotations

import subprocess
import sys


def test_the_script_parses_serves_flags_and_refuses_a_missing_url():
    proc = subprocess.run([sys.executable, "-m", "vmemkv.benchmarks.serve", "--rate", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("error: the following arguments are required: --url")


def test_the_script_runs_the_load_and_names_an_unreachable_server():
    proc = subprocess.run([sys.executable, "-m", "vmemkv.benchmarks.serve", "--url",
                           "http://127.0.0.1:9", "--rate", "1", "--num-prompts", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("serve: error: ServeConfigError: cannot list the models of "
                                  "'http://127.0.0.1:9'")
