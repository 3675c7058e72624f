"""SIGTERM (``timeout``, systemd, Slurm, Kubernetes) ends every ``vmemkv`` command as Ctrl-C does,
with status 143 and one line (vmemkv/cli.py ``SigtermAsInterrupt``); before, only ``generate``
handled it and the others died at once, with nothing printed and their temporary files left
behind. ``generate``'s own SIGTERM tests are in tests/engine/test_generate_cli_checks2.py."""
from __future__ import annotations

import os
import signal

from vmemkv.cli import TERMINATED_EXIT, SigtermAsInterrupt, command_status

from .reliability.test_cli_interrupts import interrupt, start


def test_sigterm_between_write_and_replace_keeps_the_old_trace_and_leaves_no_temp_file(tmp_path):
    """``simulate --write-trace`` held after its trace is written to the temporary file, before
    it replaces the old one: SIGTERM there ends it with one line and status 143; the old trace
    is still there, whole, and the temporary file is gone."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("OLD\n")
    proc = start("write:trace.jsonl", ["simulate", "--requests", "20", "--model-preset", "tiny",
                                       "--no-progress", "--write-trace", str(trace)], tmp_path)
    rc, out, err = interrupt(proc, signal.SIGTERM)
    assert (rc, err) == (TERMINATED_EXIT, "vmemkv simulate: terminated (SIGTERM)\n"), err
    assert TERMINATED_EXIT == 143 and out == ""
    assert trace.read_text() == "OLD\n" and os.listdir(tmp_path) == ["trace.jsonl"]


def test_a_command_that_re_raises_its_own_interrupt_still_ends_as_terminated(capsys):
    """A command catches the interrupt to say what it wrote and raises a plain KeyboardInterrupt
    (simulate, sweep and bench do): the status and the line still say SIGTERM, with its note,
    and the handler that was there before is back."""
    def command() -> int:
        try:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)   # as the signal would
        except KeyboardInterrupt:
            raise KeyboardInterrupt("wrote 3 of 5 rows") from None
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert command_status("vmemkv demo", command) == 143
    assert capsys.readouterr().err == "vmemkv demo: terminated (SIGTERM); wrote 3 of 5 rows\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_process_forked_by_a_command_is_killed_by_sigterm_not_interrupted():
    """A sweep's worker pool forks from the command; its parent ends a worker with SIGTERM,
    which must kill it (the default), not raise in whatever the worker computes."""
    with SigtermAsInterrupt().installed():
        assert isinstance(signal.getsignal(signal.SIGTERM), SigtermAsInterrupt)
        pid = os.fork()
        if pid == 0:                                      # the child: report, nothing else
            os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
