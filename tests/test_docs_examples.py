"""Every example in the README and docs/usage.md runs, so the docs never go stale.

Python blocks are executed as written, in every doc (a schematic that is not meant to run is
fenced as ``text``; a block naming the real model runs after the other tests, or skips when it
is not installed); in the README and docs/usage.md, bash blocks whose lines are ``vmemkv ...``
commands are run through the CLI's ``main`` and must exit 0, and ``vmemkv`` lines in any other
fenced block of docs/ must at least parse. The quick-start blocks (which create virtual
environments) are CI itself.
"""
import pathlib
import re
import shlex

import pytest

from vmemkv.cli import SUBCOMMANDS, build_parser, main

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_DOCS = ["README.md", "docs/usage.md"]
ALL_DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def blocks(doc, language=None):
    """Bodies of the fenced blocks of ``doc`` in ``language`` (None: every block)."""
    text = (ROOT / doc).read_text()
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


COMMAND = re.compile(r"\s*(vmemkv (%s)( .*?)?)(;|  #|$)" % "|".join(SUBCOMMANDS))
LOOP = re.compile(r"for (\w+) in ([^;]+);")


def vmemkv_lines(body):
    """The ``vmemkv <subcommand> ...`` commands of a block (not output lines such as
    ``vmemkv bench: error``), without trailing ``; done`` or ``# comment``; a shell loop
    variable (``$p`` of ``for p in a b; do``) is replaced by its first value."""
    first = {name: values.split()[0] for name, values in LOOP.findall(body)}
    lines = []
    for line in body.splitlines():
        match = COMMAND.match(line)
        if match:
            lines.append(re.sub(r"\$(\w+)", lambda m: first.get(m.group(1), m.group(0)),
                                match.group(1).rstrip()))
    return lines


REAL_MODEL = "smollm2-135m-instruct"   # blocks naming it run with the real model, after the rest


def _marks(body):
    return [pytest.mark.real_model] if REAL_MODEL in body else []


PYTHON = [pytest.param(doc, body, id=f"{doc}-python-{i}", marks=_marks(body))
          for doc in ALL_DOCS for i, body in enumerate(blocks(doc, "python"))]
COMMANDS = [pytest.param(line, id=f"{doc}-{line[:50]}")
            for doc in RUN_DOCS for body in blocks(doc, "bash") for line in vmemkv_lines(body)]


def test_the_docs_have_examples():
    assert len(PYTHON) >= 7 and len(COMMANDS) >= 5
    assert sum(len(vmemkv_lines(b)) for doc in ALL_DOCS for b in blocks(doc)) >= 12


@pytest.mark.parametrize("doc,body", PYTHON)
def test_python_example_runs(doc, body, monkeypatch, request):
    monkeypatch.chdir(ROOT)
    if REAL_MODEL in body:   # converted in the background; skips with the reason when absent
        request.getfixturevalue("real_model_dir")
    exec(compile(body, f"{doc} example", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("line", COMMANDS)
def test_cli_example_runs(line, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(line)[1:]) == 0


def test_every_cli_line_in_the_docs_parses():
    parser = build_parser()
    for doc in ALL_DOCS:
        for body in blocks(doc):
            for line in vmemkv_lines(body):
                parser.parse_args(shlex.split(line)[1:])
