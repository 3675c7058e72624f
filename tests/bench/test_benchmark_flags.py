"""Every numeric flag of every command line (the benchmarks' and ``vmemkv``'s) is a bounded
argparse type (scheduler/cliargs.py): a zero, negative or non-finite value is one line naming the
flag and exit 2, never a traceback from deep inside the run (``--repeats 0`` was "no median for
empty data", ``yardstick --mib -5`` "zeros: Dimension size must be non-negative"). Every list
flag refuses a value given twice the same way (``DistinctValues``)."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                    if "ArgumentParser(" in p.read_text())


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser the benchmark's ``main([])`` builds, caught at its first parse."""
    module = importlib.import_module(f"vmemkv.benchmarks.{module_name}")

    def capture(self, args=None, namespace=None):
        raise _Captured(self)
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Captured) as got:
            module.main([])
    return got.value.parser


def _numeric_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _numeric_actions(sub)
        elif action.type in (int, float) or getattr(action.type, "__name__", "") in ("int", "float"):
            yield parser.prog, action


def _check(parser: argparse.ArgumentParser) -> list:
    actions = list(_numeric_actions(parser))
    raw = [f"{prog} {action.option_strings}" for prog, action in actions
           if action.type in (int, float)]
    assert raw == [], "raw int/float flags: use scheduler.cliargs' bounded types"
    for prog, action in actions:
        for bad in ("-1", "nan", "x"):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(bad)
    return actions


@pytest.mark.parametrize("module_name", BENCHMARKS)
def test_every_numeric_flag_of_a_benchmark_refuses_negative_and_non_finite_values(module_name,
                                                                                  monkeypatch):
    _check(_parser_of(module_name, monkeypatch))


def test_every_numeric_flag_of_the_vmemkv_command_refuses_negative_and_non_finite_values():
    from vmemkv.cli import build_parser
    assert len(_check(build_parser())) >= 40


@pytest.mark.parametrize("module_name, argv, message", [
    ("yardstick", ["--mib", "-5"], "argument --mib: must be >= 1, got -5"),
    ("yardstick", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("attention", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("txn", ["--pools", "0"], "argument --pools: must be >= 1, got 0"),
    # a FileNotFoundError traceback after the parse (compare ran the missing interpreter)
    ("txn", ["--before-python", "/nonexistent/python"],
     "argument --before-python: '/nonexistent/python' is not an executable file"),
    ("txn", ["--before-python", "/"], "argument --before-python: '/' is not an executable file"),
    ("memory", ["--cache-gb", "-1"], "argument --cache-gb: must be > 0, got -1"),
    ("lora_sim", ["--zipf", "inf"], "argument --zipf: want a finite number, got 'inf'"),
    ("memory", ["--cache-gb", "inf"], "argument --cache-gb: want a finite number, got 'inf'"),
])
def test_a_bad_value_is_one_line_naming_the_flag(module_name, argv, message, capsys):
    # one line: argparse's usage block (1 to 3 lines) came before it
    module = importlib.import_module(f"vmemkv.benchmarks.{module_name}")
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert f": error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("module_name", BENCHMARKS)
def test_every_benchmarks_flag_mistake_is_one_line_and_exit_2(module_name, monkeypatch, capsys):
    parser = _parser_of(module_name, monkeypatch)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--no-such-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{parser.prog}: error: ")


@pytest.mark.parametrize("module_name, argv, message", [
    # 10 TiB read and copied: two arrays of it would have been allocated and touched
    ("yardstick", ["--mib", str(10 << 20)], "the yardsticks (10995116277760 bytes read and "
                                             "copied) needs 21990245138432 bytes"),
    # the pool's pages are checked against the host before any is created
    ("alloc", ["--pages", str(10**11), "--device", "cpu", "--quick"],
     "a pool of 100000000000 pages keeps about 51200000000000 bytes"),
    # a billion units: about 4.7 KB each on vmem (tracemalloc), built unit by unit
    ("txn", ["--pools", "1000", str(10**9)], "--pools 1000000000: a pool of that many units "
                                             "needs about 7629.4 GiB of host memory"),
])
def test_a_size_the_host_cannot_hold_is_refused_before_anything_is_allocated(module_name, argv,
                                                                            message, capsys):
    module = importlib.import_module(f"vmemkv.benchmarks.{module_name}")
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "Traceback" not in err


RESULT_FLAGS = ("--out", "--json")
FOLDER_FLAGS = {("plots", "--out"), ("serve", "--out")}     # these name folders


@pytest.mark.parametrize("module_name", BENCHMARKS)
def test_every_result_file_flag_is_checked_before_the_run(module_name, monkeypatch, tmp_path):
    """A result file the run writes at its end is checked when parsed (``result_file``): a
    path under a file, or a folder, was a FileExistsError traceback after the whole run."""
    parser = _parser_of(module_name, monkeypatch)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for action in parser._actions:
        flag = next((f for f in action.option_strings if f in RESULT_FLAGS), None)
        if flag is None or (module_name, flag) in FOLDER_FLAGS:
            continue
        assert getattr(action.type, "__name__", "") == "result_file", (module_name, flag)
        for bad in (str(a_file / "x.json"), str(tmp_path), ""):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(bad)
        assert action.type(str(tmp_path / "new" / "x.json")) == str(tmp_path / "new" / "x.json")


@pytest.mark.parametrize("module_name, argv, words", [
    ("memory", ["--quick", "--cache-gb", "200"], "at most --cache-gb 69.8 fits"),   # ran: a table
    ("memory", ["--quick", "--cache-gb", "0.01"], "cannot hold one 4096-token"),   # a traceback
    ("alloc", ["--quick", "--pages", "4", "--device", "foo"], "invalid choice"),
])
def test_a_benchmark_refuses_what_no_run_could_use_before_running(module_name, argv, words,
                                                                   capsys):
    module = importlib.import_module(f"vmemkv.benchmarks.{module_name}")
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def _list_flags(parser: argparse.ArgumentParser, command: tuple = ()):
    """(subcommand words, action) for every list flag (nargs "+" or "*") of ``parser`` and of
    its subcommands, found in the parser itself: a new list flag is checked without a new case."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _list_flags(sub, command + (name,))
        elif action.option_strings and action.nargs in ("+", "*"):
            yield command, action


SAMPLE_VALUES = ("1", "1x1", "x")    # a number, a BATCHxCTX pair, a name


def _one_valid_value(action: argparse.Action) -> tuple:
    """A value the flag accepts, as typed on the command line and as parsed: its first choice,
    else its first default, else the first of SAMPLE_VALUES its type takes."""
    if action.choices:
        typed = [str(next(iter(action.choices)))]
    else:
        typed = [str(v) for v in (action.default or [])[:1]] + list(SAMPLE_VALUES)
    for text in typed:
        try:
            return text, action.type(text) if action.type else text
        except argparse.ArgumentTypeError:
            continue
    raise AssertionError(f"no value found for {action.option_strings}")


@pytest.mark.parametrize("module_name", BENCHMARKS + ["vmemkv"])
def test_every_list_flag_given_a_value_twice_is_one_line_naming_it_and_exit_2(module_name,
                                                                             monkeypatch, capsys):
    """``--batches 1 1`` timed the same point twice, ``--configs 8x2048 8x2048`` was dropped in
    silence, ``--from a.json a.json`` counted one calibration twice: refused while parsing."""
    if module_name == "vmemkv":
        from vmemkv.cli import build_parser
        parser = build_parser()
    else:
        parser = _parser_of(module_name, monkeypatch)
    flags = list(_list_flags(parser))
    assert module_name != "vmemkv" or len(flags) >= 8    # calibrate's, bench --only, --goodput
    for command, action in flags:
        typed, parsed = _one_valid_value(action)
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*command, flag, typed, typed])
        err = capsys.readouterr().err
        named = "/".join(action.option_strings)
        assert info.value.code == 2 and err.count("\n") == 1, (command, flag, err)
        assert err.endswith(f": error: argument {named}: {parsed} is given twice; "
                            f"give each value once\n"), (command, flag, err)


@pytest.mark.parametrize("module_name", BENCHMARKS + ["vmemkv"])
def test_every_list_flag_given_twice_is_one_line_naming_it_and_exit_2(module_name, monkeypatch,
                                                                     capsys):
    """``--only alloc --only memory`` ran only memory: argparse's second list replaced the
    first, unsaid. Refused while parsing, as a value given twice is."""
    parser = __import__("vmemkv.cli", fromlist=["build_parser"]).build_parser() \
        if module_name == "vmemkv" else _parser_of(module_name, monkeypatch)
    for command, action in _list_flags(parser):
        typed, _ = _one_valid_value(action)
        flag, named = action.option_strings[0], "/".join(action.option_strings)
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*command, flag, typed, flag, typed])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1, (command, flag, err)
        assert err.endswith(f": error: argument {named}: given twice (the second list would "
                            f"replace the first); give every value after one {named}\n"), err
