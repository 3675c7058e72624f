"""`vmemkv --help`, `--version` and every subcommand's `--help`: what a new user reads first."""
import argparse

import pytest

import vmemkv
from vmemkv.cli import SUBCOMMANDS, HelpFormatter, build_parser, main


def _subparsers():
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"vmemkv {vmemkv.__version__}\n"


def test_top_help_is_for_users_with_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "registered by the module" not in out and "subcommand per job" not in out
    assert "examples" in out and "vmemkv bench --quick" in out and "--version" in out
    assert all(name in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_flag_has_a_help_line_that_shows_its_default(command):
    parser = _subparsers()[command]
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action)
        assert text.strip(), f"{command} {action.option_strings} has no help line"
        if not isinstance(action, argparse._StoreTrueAction):
            assert "default" in text, f"{command} {action.option_strings}: no default in {text!r}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_help_describes_it_without_developer_markup(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and parser_description_line(out)
    assert "(default:" in out or command == "info"     # info has one flag, --json


def parser_description_line(help_text: str) -> str:
    """The first line after the usage block: the subcommand's description."""
    return help_text.split("\n\n")[1].strip()


def test_one_size_syntax_in_every_subcommand():
    parsers = _subparsers()
    generate = parsers["generate"].parse_args(["--page-bytes", "64KiB", "--cache-bytes", "1GiB"])
    simulate = parsers["simulate"].parse_args(["--page-bytes", "64KiB"])
    assert generate.page_bytes == simulate.page_size == 64 * 2**10
    assert generate.cache_bytes == 2**30
