"""``vmemkv generate``'s prompt files read as written, its output to a reader that goes away,
and Ctrl-C with ``--chat --json`` (runtime/generate_io.py, generate_cli.py)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from vmemkv.cli import main
from vmemkv.runtime.generate_io import GenerateUsageError, read_prompts

from .test_generate_chat_cli import _write, chat_checkpoint  # noqa: F401 (a fixture)


def prompts_of(tmp_path, raw: bytes, name: str = "p.txt", **kwargs):
    path = tmp_path / name
    path.write_bytes(raw)
    return read_prompts(str(path), kwargs.pop("has_tokenizer", True), **kwargs)


def test_only_ascii_digits_are_token_ids(tmp_path):
    # fullwidth (CJK) digits were read as the id 123; circled ones were an int() ValueError
    assert prompts_of(tmp_path, "１２３\n1 2 3\n① ②\n".encode()) == ["１２３", [1, 2, 3], "① ②"]
    with pytest.raises(GenerateUsageError, match="prompt line 1 is not space-separated token ids"):
        prompts_of(tmp_path, "١٢ ٣\n".encode(), has_tokenizer=False)


def test_a_byte_order_mark_and_crlf_are_no_part_of_the_prompts(tmp_path):
    # a BOM made the ids "1 2 3" text (8 tokens), and a --chat JSONL line plain text
    assert prompts_of(tmp_path, b"\xef\xbb\xbf1 2 3\r\n4 5\r\n") == [[1, 2, 3], [4, 5]]
    chat = b"\xef\xbb\xbf" + json.dumps([{"role": "user", "content": "hi"}]).encode() + b"\n"
    assert prompts_of(tmp_path, chat, chat=True) == [[{"role": "user", "content": "hi"}]]


def test_lines_end_at_newlines_only_and_text_keeps_its_spaces(tmp_path):
    # splitlines() also split at a form feed (two requests) and at a raw U+2028 inside a JSON
    # string (refused as unterminated); strip() dropped spaces that are tokens of the text
    assert prompts_of(tmp_path, b"1 2 3\x0c4 5 6\n") == [[1, 2, 3, 4, 5, 6]]
    assert prompts_of(tmp_path, b"a\x0cb\n  indented \n") == ["a\x0cb", "  indented "]
    line = json.dumps("one\u2028two", ensure_ascii=False).encode() + b"\n"
    assert prompts_of(tmp_path, line, name="p.jsonl") == ["one\u2028two"]



def test_a_file_that_is_not_utf8_is_a_usage_error_naming_it_and_the_line(tmp_path):
    # a bare UnicodeDecodeError ("byte 0xff in position 6") named neither file nor line
    with pytest.raises(GenerateUsageError, match=r"prompts file '.*p\.txt' is not UTF-8 text: "
                                                 r"line 3 holds byte 0xff"):
        prompts_of(tmp_path, "héllo\n1 2\n".encode() + b"bad \xff\xfe\n")
    # text mode's newlines are kept: "\r\n" and a lone "\r" end a line
    assert prompts_of(tmp_path, b"1 2\r\n3\r4\n") == [[1, 2], [3], [4]]


def test_stdin_that_is_not_utf8_names_the_line_and_byte(monkeypatch):
    # stdin's own decoder (surrogateescape under a C locale) let 0xff through as a lone
    # surrogate: "prompt 1 holds a lone surrogate", the wrong line named, the byte not
    stdin = io.TextIOWrapper(io.BytesIO(b"hello\r\nwor\xffld\n"), encoding="utf-8",
                             errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(GenerateUsageError, match=r"prompts on stdin are not UTF-8 text: line 2 "
                                                 r"holds byte 0xff \(invalid start byte\)"):
        read_prompts("-", True)
    stdin = io.TextIOWrapper(io.BytesIO("héllo\r\n1 2\r".encode()), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    assert read_prompts("-", True) == ["héllo", [1, 2]]


def test_a_reader_that_closes_stdout_ends_generate_quietly(tmp_path):
    """`vmemkv generate ... | head -1` printed "error: BrokenPipeError" and exit 2; the pipe is
    closed before generate writes a line."""
    path = tmp_path / "p.txt"
    path.write_text("1 2 3\n4 5 6\n")
    read, write = os.pipe()
    os.close(read)
    code = "import sys; from vmemkv.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "generate", "--prompts", str(path),
                           "--max-new-tokens", "2", "--no-progress", "--json"],
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr and "tok/s" in done.stderr


def test_ctrl_c_with_chat_json_prints_the_finished_samples_with_their_messages(
        chat_checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811 (the fixture)
    def interrupt(name, timeout_s=0.0):
        raise KeyboardInterrupt
    monkeypatch.setattr("vmemkv.runtime.generate_cli.hold_point", interrupt)
    chats = [[{"role": "user", "content": "hi"}]]
    code = main(["generate", "--no-progress", "--max-new-tokens", "2", "--max-context", "128",
                 "--model", str(chat_checkpoint), "--chat", "--json",
                 "--prompts", _write(tmp_path, chats)])
    out, err = capsys.readouterr()
    assert code == 130 and "printed the 1 of 1 samples" in err
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert record["messages"] == chats[0] and len(record["outputs"][0]["token_ids"]) == 2


def test_the_summary_says_n_a_for_a_latency_nothing_measured(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n"))
    assert main(["generate", "--max-new-tokens", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "ITL p50 n/a" in err and "nan" not in err


def test_a_refused_prompt_is_named_by_its_line(monkeypatch, capsys):
    # the engine names a prompt by its place in the batch ("prompt 1"): blank lines are
    # skipped, so that was no line a user could find; generate names the line, as its own
    # file errors do
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n\n\n1 2 3 4 5 6 7 8 9 10\n"))
    assert main(["generate", "--max-new-tokens", "2", "--max-context", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "RequestRejectedError: prompt line 4 rejected: 10 prompt + 2 new tokens" in err
    assert "prompt 1" not in err


def test_name_prompt_line_rewrites_only_the_prompts_own_name():
    from vmemkv.runtime.engine.chat import ChatMessageError
    from vmemkv.runtime.generate_io import name_prompt_line
    lines = [1, 4, 9]
    error = name_prompt_line(ChatMessageError("conversation 2: messages[0].role ...", 2), lines)
    assert str(error) == "prompt line 9: messages[0].role ..." and error.index == 2
    for untouched in [ChatMessageError("conversation 21: x", 2),    # another number
                      ChatMessageError("min_tokens 3 masks every stop id", 0),
                      ChatMessageError("prompt 7 is empty", 7)]:   # no such prompt
        assert str(name_prompt_line(untouched, lines)) == untouched.args[0]
