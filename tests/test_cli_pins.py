"""Pins of ``vmemkv``'s top-level command line (vmemkv/cli.py): how a command's error ends."""
from __future__ import annotations

from vmemkv.cli import command_status, missing_extra


def test_a_file_error_is_one_line_and_status_2(capsys):
    def body():
        raise FileNotFoundError(2, "No such file or directory", "/nope/trace.jsonl")
    assert command_status("vmemkv simulate", body) == 2
    assert capsys.readouterr().err == ("vmemkv simulate: error: FileNotFoundError: [Errno 2] No such "
                                       "file or directory: '/nope/trace.jsonl'\n")


def test_a_submodule_of_an_extra_names_the_extra():
    error = ModuleNotFoundError("No module named 'transformers.models'", name="transformers.models")
    assert missing_extra(error) == "transformers is not installed: pip install 'vmemkv[hf]'"
    assert missing_extra(ModuleNotFoundError("x", name="torchx")) is None


def test_help_shows_a_default_only_where_there_is_one():
    from vmemkv.cli import OneLineArgumentParser
    parser = OneLineArgumentParser(prog="x")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--max-batch", type=int, default=8, help="sequences at once")
    text = " ".join(parser.format_help().split())
    assert "one JSON object (default" not in text
    assert "sequences at once (default: 8)" in text
