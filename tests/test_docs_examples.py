"""Every example in the README and docs/usage.md runs, so the docs never go stale.

Python blocks are executed as written; bash blocks whose lines are ``vmemkv ...`` commands are
run through the CLI's ``main`` and must exit 0. ``vmemkv`` lines anywhere else in docs/ must at
least parse. The quick-start blocks (which create virtual environments) are CI itself.
"""
import pathlib
import re
import shlex

import pytest

from runtime.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_DOCS = ["README.md", "docs/usage.md"]
FENCE = re.compile(r"```(python|bash)\n(.*?)```", re.S)


def blocks(doc, language):
    text = (ROOT / doc).read_text()
    return [body for lang, body in FENCE.findall(text) if lang == language]


def vmemkv_lines(body):
    return [line for line in body.splitlines() if line.startswith("vmemkv ")]


PYTHON = [pytest.param(doc, body, id=f"{doc}-python-{i}")
          for doc in RUN_DOCS for i, body in enumerate(blocks(doc, "python"))]
COMMANDS = [pytest.param(line, id=f"{doc}-{line[:50]}")
            for doc in RUN_DOCS for body in blocks(doc, "bash") for line in vmemkv_lines(body)]


def test_the_docs_have_examples():
    assert len(PYTHON) >= 7 and len(COMMANDS) >= 5


@pytest.mark.parametrize("doc,body", PYTHON)
def test_python_example_runs(doc, body, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(body, f"{doc} example", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("line", COMMANDS)
def test_cli_example_runs(line, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(line)[1:]) == 0


def test_every_cli_line_in_the_docs_parses():
    parser = build_parser()
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for body in blocks(doc.relative_to(ROOT), "bash"):
            for line in vmemkv_lines(body):
                words = [w for w in shlex.split(line)[1:] if "$" not in w]
                parser.parse_args(words)
