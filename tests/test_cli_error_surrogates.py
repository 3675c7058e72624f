"""The command line's one-line errors carry text a user or a template gave: a chat template's
``raise_exception("bad \\ud800")`` reaches ``vmemkv generate --chat`` inside ChatTemplateError's
message as a lone surrogate. On a stderr whose errors are strict (a wrapper's, an embedding's)
writing it raised UnicodeEncodeError, a traceback in place of ``PROG: error: LINE`` and exit
status 2; now every error line (``command_status``, ``interrupted_exit``, a bad flag) writes
each lone surrogate as its escape, the rest of the text as it is."""
from __future__ import annotations

import io

import pytest

from vmemkv.cli import build_parser, command_status, interrupted_exit
from vmemkv.runtime.engine.chat import ChatTemplateError, chat_prompt_ids

from .engine.byte_tokenizer import byte_tokenizer

RAISING = '{{ raise_exception("bad \ud800 é") }}'


def strict_stderr(monkeypatch) -> io.BytesIO:
    """stderr as a wrapper opens it, UTF-8 with strict errors (set in the test's body: pytest
    swaps its own in between phases); returns the bytes written to it."""
    raw = io.BytesIO()
    monkeypatch.setattr("sys.stderr", io.TextIOWrapper(raw, encoding="utf-8",
                                                       write_through=True))
    return raw


def template_error() -> ChatTemplateError:
    with pytest.raises(ChatTemplateError) as caught:
        chat_prompt_ids(byte_tokenizer(chat_template=True), [{"role": "user", "content": "hi"}],
                        chat_template=RAISING)
    assert "bad \ud800 é" in str(caught.value)       # the library keeps the template's text
    return caught.value


def test_a_chat_templates_lone_surrogate_is_one_escaped_error_line(monkeypatch):
    error = template_error()
    written = strict_stderr(monkeypatch)

    def body():
        raise error
    assert command_status("vmemkv generate", body) == 2
    assert written.getvalue().decode("utf-8") == (
        "vmemkv generate: error: ChatTemplateError: conversation 0: the chat template does "
        "not render these messages: TemplateError: bad \\ud800 é\n")


def test_an_interrupts_note_and_a_bad_flag_are_escaped_too(monkeypatch):
    written = strict_stderr(monkeypatch)
    assert interrupted_exit("vmemkv generate", KeyboardInterrupt("wrote a\udc80b"), False) == 130
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["generate", "--no-such-flag\udcff"])
    assert exited.value.code == 2
    lines = written.getvalue().decode("utf-8").splitlines()
    assert lines[0] == "vmemkv generate: interrupted; wrote a\\udc80b"
    assert lines[1].startswith("vmemkv: error: ") and "--no-such-flag\\udcff" in lines[1]
