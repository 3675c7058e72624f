"""``vmemkv generate``'s prompts in and samples out.

In: a text file, one prompt per non-empty line (space-separated token ids, or text with a
tokenizer); or JSONL (``--chat``, or a file named ``*.jsonl``): one JSON value per line, which
can hold newlines. In JSONL a line is a string (text; with ``--chat``, one user message), a list
of ints (token ids) or, with ``--chat``, a conversation: a list of {"role", "content"} messages.
With ``--chat`` a line that does not open as JSON does (``[``, ``{`` or ``"``) is plain text, one
user message, so ``echo 'Hi!' | vmemkv generate --chat`` works.
``--system TEXT`` puts a system message first in every conversation that has none. A line of
token ids is sent as it is, without the chat template, so ``--system`` refuses one; ``--text``
applies to plain-text files only (JSON says itself what a line is), so ``--chat`` or a
``*.jsonl`` file refuses it.

Out: one line per sample, or, when samples are labelled (``--n`` > 1, ``--chat``, or any text
spanning lines), ``[prompt P sample S]`` then the text with every further line indented by four
spaces; ``--json``: one JSON object per request. A line ends at "\n", "\r\n" or a lone "\r"
(a token of their own in byte-level vocabularies; Python's text files end lines there too).
"""
from __future__ import annotations

import json
import re
import sys
from typing import List, Optional, Tuple, Union

INDENT = "    "
LINE_BREAK = re.compile(r"\r\n|\r|\n")
Prompt = Union[List[int], str, List[dict]]


class GenerateUsageError(ValueError):
    """A bad input to ``vmemkv generate`` (prompt file, prompt text without a tokenizer)."""


def read_prompts(path: str, has_tokenizer: bool, text_only: bool = False, chat: bool = False,
                 system: Optional[str] = None) -> List[Prompt]:
    """The prompts of ``path`` (or stdin), as the module docstring says."""
    return [prompt for _, prompt in
            read_numbered_prompts(path, has_tokenizer, text_only, chat, system)]


def read_numbered_prompts(path: str, has_tokenizer: bool, text_only: bool = False,
                          chat: bool = False, system: Optional[str] = None
                          ) -> List[Tuple[int, Prompt]]:
    """``read_prompts``' prompts, each with the number of the line it was read from."""
    check_prompt_flags(path, text_only, chat, system)
    return parse_prompt_lines(read_prompt_lines(path), path, has_tokenizer, text_only, chat, system)


def check_prompt_flags(path: str, text_only: bool, chat: bool, system: Optional[str]) -> None:
    """The refusals --prompts, --text, --chat and --system decide together, with no model
    (stdin closed, ``<&-``: Python's None, refused before the model loads, not after)."""
    if path == "-" and sys.stdin is None:
        raise GenerateUsageError("--prompts - reads stdin, which is closed: give --prompts FILE "
                                 "or pipe the prompts in")
    if system is not None and not chat:
        raise GenerateUsageError("--system sets the system message of chat conversations: give "
                                 "--chat too")
    if text_only and (chat or path.endswith(".jsonl")):
        given = "--chat" if chat else f"--prompts {path!r} (a *.jsonl file)"
        raise GenerateUsageError(f"--text reads the lines of a plain-text prompts file as text; "
                                 f"with {given} every line is JSON, which says itself whether it "
                                 f"is text or token ids, so --text would do nothing: drop it")


def read_prompt_lines(path: str) -> List[Tuple[int, str]]:
    """The non-blank lines of ``path`` (or stdin) with their numbers (generate reads a file's
    before the model loads: a missing file or bad UTF-8 is refused at once)."""
    text = _read_text(path)
    # a byte-order mark (Windows editors) is no part of the first prompt; lines end at "\n"
    # only (splitlines also split at form feeds and U+2028, which JSON strings may hold raw)
    text = text.removeprefix("\ufeff")
    return [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)
            if line.strip()]


def parse_prompt_lines(lines: List[Tuple[int, str]], path: str, has_tokenizer: bool,
                       text_only: bool = False, chat: bool = False,
                       system: Optional[str] = None) -> List[Tuple[int, Prompt]]:
    """``read_prompt_lines``' lines as prompts, once the model (and its tokenizer) is known."""
    if text_only and not has_tokenizer:
        raise GenerateUsageError("--text needs a model with a tokenizer; this one has none")
    if chat and not has_tokenizer:
        raise GenerateUsageError("--chat needs a model with a tokenizer and a chat template; "
                                 "this one has no tokenizer")
    if chat or path.endswith(".jsonl"):
        prompts = [(n, _json_prompt(n, line, has_tokenizer, chat, system)) for n, line in lines]
    else:
        prompts = [(n, _text_prompt(n, line, has_tokenizer, text_only)) for n, line in lines]
    if not prompts:
        raise GenerateUsageError(f"no prompts in {'stdin' if path == '-' else path!r}")
    return prompts


def _read_text(path: str) -> str:
    """The text of ``path`` (or stdin), UTF-8, "\r\n" and "\r" read as "\n" (text mode's
    newlines); GenerateUsageError naming the file and the line of a byte that is not UTF-8."""
    where = "prompts on stdin are" if path == "-" else f"prompts file {path!r} is"
    try:
        if path == "-":
            # stdin's bytes, decoded here: its own decoder lets bad bytes through as lone
            # surrogates under a C locale (surrogateescape); a stdin of text alone (a
            # StringIO) is read as it is
            stream = getattr(sys.stdin, "buffer", None)
            if stream is None:
                return _newlines(sys.stdin.read())
            raw = stream.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except OSError as error:
        raise GenerateUsageError(f"cannot read prompts from {path!r}: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise GenerateUsageError(f"{where} not UTF-8 text: line {line} holds "
                                 f"byte {raw[error.start]:#04x} ({error.reason})") from None
    return _newlines(text)


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _text_prompt(number: int, line: str, has_tokenizer: bool, text_only: bool) -> Prompt:
    """Token ids when every word is ASCII digits (fullwidth "１２３" is text); else the line,
    spaces included (they are tokens too)."""
    parts = line.split()
    if not text_only and all(p.isascii() and p.isdigit() for p in parts):
        return [int(p) for p in parts]
    if has_tokenizer:
        return line
    raise GenerateUsageError(f"prompt line {number} is not space-separated token ids and "
                             f"the model has no tokenizer: {line[:40]!r}")


def _json_prompt(number: int, line: str, has_tokenizer: bool, chat: bool,
                 system: Optional[str]) -> Prompt:
    line = line.strip()                   # JSON's own spaces; a text line's are kept
    if chat and line[0] not in '[{"':     # plain text: one user message
        return _conversation([{"role": "user", "content": line}], system)
    try:
        value = json.loads(line)
    except RecursionError:               # the parser's own depth limit: no prompt nests so deep
        raise GenerateUsageError(f"prompt line {number} nests too deeply to be a prompt: "
                                 f"{line[:40]!r}") from None
    except ValueError as error:
        raise GenerateUsageError(f"prompt line {number} is not JSON ({error}): {line[:40]!r}") from None
    if isinstance(value, str):
        if not has_tokenizer:
            raise GenerateUsageError(f"prompt line {number} is text and the model has no tokenizer")
        return _conversation([{"role": "user", "content": value}], system) if chat else value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        if system is not None:
            raise GenerateUsageError(f"prompt line {number} is token ids, sent as they are "
                                     f"without the chat template, so --system cannot apply to "
                                     f"it: give the line as text or a conversation")
        return value
    if chat and isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return _conversation(value, system)
    wanted = "a string, a list of token ids or a list of {role, content} messages" if chat else \
             "a string or a list of token ids (conversations need --chat)"
    raise GenerateUsageError(f"prompt line {number} must be {wanted}, got {line[:40]!r}")


def _conversation(messages: List[dict], system: Optional[str]) -> List[dict]:
    from vmemkv.runtime.engine.chat import with_system
    return with_system(messages, system)


def format_output(out, as_json: bool, labelled: bool = False, messages=None) -> str:
    """One JSON object per request, or its samples as text (labelled: see the docstring); each
    line ends with a newline."""
    if as_json:
        record = {"request_id": out.request_id, "prompt": out.prompt,
                  "prompt_token_ids": list(out.prompt_token_ids),
                  "outputs": [{"index": o.index, "token_ids": o.token_ids, "text": o.text,
                               "finish_reason": o.finish_reason} for o in out.outputs]}
        if messages is not None:
            record["messages"] = messages
        return json.dumps(record, ensure_ascii=False) + "\n"
    lines = []
    for o in out.outputs:
        text = o.text if o.text is not None else " ".join(map(str, o.token_ids))
        lines.append(f"[prompt {out.request_id} sample {o.index}] "
                     + LINE_BREAK.sub(lambda brk: brk.group() + INDENT, text) if labelled else text)
    return "".join(line + "\n" for line in lines)


def needs_labels(outputs, n: int, chat: bool) -> bool:
    return n > 1 or chat or any(o.text and LINE_BREAK.search(o.text) for out in outputs
                                for o in out.outputs)


def name_prompt_line(error: Exception, line_numbers: List[int],
                     max_context: Optional[int] = None) -> Exception:
    """``error`` (RequestRejectedError: "prompt I ..." or "conversation I ...", I the prompt's
    place in the batch) naming the line its prompt was read from instead, as the file's own
    errors do ("prompt line N ..."): blank lines are skipped, so I is no line a user can find.
    With ``max_context``, the scheduler's "(max_seq_len M)" is named by the flag that set it,
    "(--max-context M)", as the refusal before tokenizing names it."""
    index = getattr(error, "index", None)
    message = str(error)
    if index is None or not 0 <= index < len(line_numbers) or not error.args:
        return error
    if max_context is not None:
        message = message.replace(f"(max_seq_len {max_context})", f"(--max-context {max_context})")
    for start in (f"prompt {index}", f"conversation {index}"):
        if message.startswith(start) and message[len(start):len(start) + 1] in (" ", ":"):
            message = f"prompt line {line_numbers[index]}" + message[len(start):]
            break
    if message != str(error):
        error.args = (message,) + error.args[1:]
    return error
