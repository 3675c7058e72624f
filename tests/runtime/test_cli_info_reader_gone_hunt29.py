"""``vmemkv info`` whose reader has gone (``vmemkv info | head -0``; runtime/info.py): it ends
quietly with status 0, as generate's and sweep's output does, not with "error: BrokenPipeError"
and status 2."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest

from vmemkv.cli import main


@pytest.mark.parametrize("argv", [["info"], ["info", "--json"]])
def test_info_into_a_pipe_with_no_reader_ends_quietly_with_status_0(capsys, monkeypatch, argv):
    read_end, write_end = os.pipe()
    os.close(read_end)                           # the reader is gone before the first write
    stdout = os.fdopen(write_end, "w", buffering=1)   # each line written as it is printed
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert main(argv) == 0
    finally:
        with contextlib.suppress(BrokenPipeError):   # the old code left lines in the buffer
            stdout.close()
    assert capsys.readouterr().err == ""
