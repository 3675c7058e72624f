"""A benchmark script whose result file cannot be written ends as ``vmemkv``'s commands do: one
line naming the path, status 2, no traceback, the old file intact (benchmarks/common.py
``exit_status``, each script's ``__main__`` line). Before, a full traceback and status 1.

The write is made to fail where it happens, after the run, by a file-size limit on the
subprocess (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG): ``--out`` and ``--json``
are checked before a run starts, so a path that is plainly wrong never gets that far."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys


def _limit_file_size_to_300_bytes() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))


def test_a_result_file_that_cannot_be_written_is_one_line_naming_it_and_status_2(tmp_path):
    result = tmp_path / "plan.json"
    result.write_text("OLD\n")
    proc = subprocess.run([sys.executable, "-m", "vmemkv.benchmarks.plan_size", "--seqs", "1",
                           "--decodes", "1", "--json", str(result)],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size_to_300_bytes)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"plan_size: error: OSError: [Errno 27] File too large: '{result}'\n"
    assert result.read_text() == "OLD\n" and os.listdir(tmp_path) == ["plan.json"]
