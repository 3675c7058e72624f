"""``vmemkv generate``: a prompt provably too long for --max-context beside --max-new-tokens (a
byte-level BPE's bound, ``serve/text_bounds``) is refused before it is tokenized, as the server
refuses one: a 4 MiB ``--chat`` message (or text line) was tokenized, seconds of CPU, only to be
refused for its length. The refusal is exact (one token less runs) and names the file's line."""
from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

import vmemkv.runtime.models as models
from vmemkv.cli import main

from .byte_tokenizer import CHAT_TEMPLATE, byte_tokenizer
from .conftest import model

MAX_CONTEXT, MAX_NEW_TOKENS = 64, 6
CHAT_FRAME_CHARS = len("<user>\n<assistant>")   # what CHAT_TEMPLATE adds around one message
FITS_CHARS = MAX_CONTEXT - MAX_NEW_TOKENS - CHAT_FRAME_CHARS   # one byte token a character


class CountingTokenizer(PreTrainedTokenizerFast):
    """The byte tokenizer, counting the times it is asked to encode (text or a template)."""
    calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A checkpoint of tiny-llama and the byte tokenizer; load_model hands generate a counting
    copy of its tokenizer, returned here."""
    model().save_pretrained(tmp_path / "ckpt")
    byte_tokenizer(chat_template=True).save_pretrained(tmp_path / "ckpt")
    backend = byte_tokenizer().backend_tokenizer
    tok = CountingTokenizer(tokenizer_object=backend.from_str(backend.to_str()))
    tok.chat_template = CHAT_TEMPLATE
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (load(*a, **k)[0], tok))
    return tmp_path / "ckpt", tok


def _generate(capsys, checkpoint, prompts_path, *flags) -> tuple:
    capsys.readouterr()
    code = main(["generate", "--no-progress", "--model", str(checkpoint), "--prompts",
                 str(prompts_path), "--max-context", str(MAX_CONTEXT), "--max-new-tokens",
                 str(MAX_NEW_TOKENS), "--ignore-eos", *flags])
    return (code, *capsys.readouterr())


@pytest.mark.parametrize("chars, refused", [(FITS_CHARS, False), (FITS_CHARS + 1, True),
                                            (4 * 2**20, True)])
def test_a_chat_message_too_long_is_refused_before_tokenizing_and_one_less_runs(
        counted, tmp_path, capsys, chars, refused):
    checkpoint, tok = counted
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps("hi") + "\n\n" + json.dumps("x" * chars) + "\n")
    code, out, err = _generate(capsys, checkpoint, chats, "--chat", "--json")
    if not refused:
        assert code == 0, err
        records = [json.loads(line) for line in out.splitlines()[:-1]]
        assert len(records[1]["prompt_token_ids"]) == MAX_CONTEXT - MAX_NEW_TOKENS
        assert len(records[1]["outputs"][0]["token_ids"]) == MAX_NEW_TOKENS
        return
    assert code == 2 and out == ""
    least = chars + CHAT_FRAME_CHARS
    assert err == (f"vmemkv generate: error: RequestRejectedError: prompt line 3 rejected: at "
                   f"least {least} prompt tokens ({least:,} characters, at most 1 a token; found "
                   f"without tokenizing it) + {MAX_NEW_TOKENS} new tokens exceed the "
                   f"{MAX_CONTEXT} tokens one sequence may hold (--max-context {MAX_CONTEXT})\n")
    assert tok.calls == 1          # the first line's conversation only: the long one never


def test_a_text_line_too_long_is_refused_before_tokenizing(counted, tmp_path, capsys):
    checkpoint, tok = counted
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n" + "x" * (4 * 2**20) + "\n")
    code, out, err = _generate(capsys, checkpoint, prompts)
    assert code == 2 and out == ""
    assert err.startswith("vmemkv generate: error: RequestRejectedError: prompt line 2 rejected: "
                          f"at least {4 * 2**20} prompt tokens"), err
    assert tok.calls == 0          # text lines are tokenized by the engine, after every check
