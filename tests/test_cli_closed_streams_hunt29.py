"""``vmemkv`` started with a standard stream closed (``>&-``, ``<&-``, ``2>&-``: Python's
sys.stdout / stdin / stderr is None; vmemkv/cli.py, runtime/generate_io.py): a closed stdout is
refused with one line and status 2 before the command runs (``info`` printed into nothing and
exited 0; ``generate`` ran the whole batch, then died on an AttributeError traceback); a closed
stdin under ``generate --prompts -`` is refused naming the flag before the model loads (an
AttributeError traceback after it); a closed stderr leaves a user error its status 2 (the one
line had nowhere to go: an AttributeError traceback)."""
from __future__ import annotations

import sys

import pytest

from vmemkv.cli import main


def _no_model_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for a command refused before it")
    monkeypatch.setattr("vmemkv.runtime.models.load_model", refuse)


@pytest.mark.parametrize("argv", [["info"], ["generate", "--no-progress"]])
def test_a_closed_stdout_is_refused_before_the_command_runs(capsys, monkeypatch, argv):
    _no_model_load(monkeypatch)
    monkeypatch.setattr(sys, "stdout", None)
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"vmemkv {argv[0]}: error: stdout is closed, so the results would be lost: redirect it "
        f"(> FILE, or > /dev/null to drop them)\n")


def test_a_closed_stdin_is_refused_naming_the_flag_before_the_model_loads(capsys, monkeypatch):
    _no_model_load(monkeypatch)
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["generate", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "vmemkv generate: error: GenerateUsageError: --prompts - reads stdin, which is closed: "
        "give --prompts FILE or pipe the prompts in\n")


def test_a_closed_stderr_leaves_a_bad_flag_its_status_2(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
