"""``python -m vmemkv.cli`` (the tests' way in) ends as the ``vmemkv`` script does. Run as
``__main__``, vmemkv/cli.py was a second copy of the module: a subcommand's
``vmemkv.cli.UsageError`` was not the copy's class, so it escaped as a traceback, status 1."""
from __future__ import annotations

import subprocess
import sys


def test_a_subcommands_usage_error_is_one_line_and_status_2_under_python_m(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "bench_out"       # bench's --out folder under a file: UsageError
    proc = subprocess.run([sys.executable, "-m", "vmemkv.cli", "bench", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr == (f"vmemkv bench: error: --out {out}: {out}/STALE.txt: "
                           f"{tmp_path / 'a_file'} is not a folder\n")
