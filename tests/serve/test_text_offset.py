"""Completions' ``logprobs.text_offset``: an index into the choice's text (echo + output) that
never goes back and never passes the text; a token holding part of a multi-byte character points
at that character; streamed and not alike; the ``tokens`` strings as before (a piece of a
character decodes alone as U+FFFD). The old offsets counted each such token's own string (one
U+FFFD), so an echoed "Emoji party: 🎉🎉" ran past its 15 characters and the output's offsets
restarted at len(echo): [0, 2, 5, 11, 12, 14, 15, 16, 17, 18, 15, ...]."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.serve.completions import CompletionFormat, ServedModel
from vmemkv.runtime.serve import logprobs_format
from vmemkv.runtime.serve.protocol import CompletionRequest
from vmemkv.runtime.serve.submission import Choice, Delta

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from ..engine.test_text_prompts import make_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving, wait_until_idle

REPLACEMENT = "\ufffd"
EMOJI = "Emoji party: 🎉🎉"      # 15 characters, 21 UTF-8 bytes
CJK = "日本語で「こんにちは」は"


def decoded_prefix_offsets(tokenizer, ids, skip_special_tokens=False) -> list:
    """The definition the slow way: where token i starts in what ids[:i + 1] decode to: the
    text of ids[:i] as far as token i leaves it, less a trailing partial character (a U+FFFD
    run that still ends the text with token i: a character it may continue). A U+FFFD that
    token i leaves behind (a broken character: a prompt's token ids ended inside it, or the
    model never finished it) is text it starts after."""
    def decoded(end: int) -> str:
        return tokenizer.decode(list(ids[:end]), skip_special_tokens=skip_special_tokens)

    offsets = []
    for i in range(len(ids)):
        before, after = decoded(i), decoded(i + 1)
        kept = next((c for c, (x, y) in enumerate(zip(before, after)) if x != y),
                    min(len(before), len(after)))
        offsets.append(min(kept, len(after.rstrip(REPLACEMENT))))
    return offsets


class LongestDecode:
    """The real tokenizer, recording the most tokens one decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest_tokens = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.longest_tokens = max(self.longest_tokens, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.real_model
def test_smollm2_tokens_inside_a_character_point_at_it(real_model_dir):
    from transformers import AutoTokenizer
    from vmemkv.runtime.serve.logprobs_format import (TextOffsets, TokenStrings,
                                                      completion_logprobs, echo_offsets)
    tok = AutoTokenizer.from_pretrained(str(real_model_dir))
    ids = tok(EMOJI)["input_ids"]            # Em oji ␣party : ␣F0 9F, 8E, 89, F0 9F, 8E, 89
    want = [0, 2, 5, 11, 12, 13, 13, 14, 14, 14]
    assert echo_offsets(tok, ids, EMOJI) == want == decoded_prefix_offsets(tok, ids)
    out = completion_logprobs(TokenStrings(tok), ids, [None] * len(ids), want)
    # named by their bytes where those are not whole characters (each U+FFFD alone)
    assert out["tokens"] == ["Em", "oji", " party", ":", "bytes:\\x20\\xf0\\x9f", "bytes:\\x8e",
                             "bytes:\\x89", "bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    cjk = tok(CJK)["input_ids"]              # 23 tokens for 12 characters
    assert echo_offsets(tok, cjk, CJK) == [0, 0, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 8, 8,
                                           9, 9, 10, 10, 11, 11] == decoded_prefix_offsets(tok, cjk)
    # as an output after its echo, token by token, each decode a few tokens, not the prefix
    counting = LongestDecode(tok)
    long_ids = tok(" ".join([EMOJI, CJK] * 20))["input_ids"]
    offsets = TextOffsets(counting, start_chars=len(EMOJI), skip_special_tokens=True)
    assert [offsets.add(t) for t in long_ids] \
        == [len(EMOJI) + o for o in decoded_prefix_offsets(tok, long_ids)]
    assert len(long_ids) == 680 and counting.longest_tokens <= 6


def test_a_bos_the_echo_lacks_is_not_counted():
    tok = make_tokenizer()                   # "<s>" in front of every encoding, like Llama's
    text = "the quick brown fox"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == "<s> " + text
    # each word at itself or at the space before it, as GPT-2's " party"
    assert logprobs_format.echo_offsets(tok, ids, text) == [0, 0, 3, 9, 15]


def test_echoed_emoji_offsets_index_the_text_streamed_and_not():
    """A real byte-level tokenizer (one token a byte) and random weights: the output holds
    split and broken characters alike."""
    tok = byte_tokenizer()
    body = {"prompt": EMOJI, "max_tokens": 16, "temperature": 1.0, "ignore_eos": True,
            "logprobs": 1, "echo": True}
    with serving(VMEM, tokenizer=tok) as (server, engine):
        request = {**body, "seed": 0}
        done = local_http.post(server.url + "/v1/completions", json=request).json()["choices"][0]
        text, lp = done["text"], done["logprobs"]
        assert REPLACEMENT in text[len(EMOJI):]   # what the old offsets counted one per token
        ids = list(EMOJI.encode()) + done["token_ids"]
        assert lp["tokens"] == [logprobs_format.TokenStrings(tok).key(t) for t in ids]
        offsets = lp["text_offset"]
        assert offsets[:21] == list(range(13)) + [13] * 4 + [14] * 4
        assert offsets[21:] == [min(len(EMOJI) + o, len(text)) for o in
                                decoded_prefix_offsets(tok, done["token_ids"], True)]
        assert offsets == sorted(offsets) and offsets[-1] <= len(text)
        assert streamed(server.url, request) == (text, lp["tokens"], offsets)
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


def streamed_choices(url: str, request: dict):
    """Each choice of each chunk of ``request`` streamed from /v1/completions, in order."""
    with local_http.stream("POST", url + "/v1/completions", json={**request, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                yield from json.loads(line[5:])["choices"]


def streamed(url: str, request: dict) -> tuple:
    text, tokens, offsets = "", [], []
    for c in streamed_choices(url, request):
        text += c["text"]
        tokens += c["logprobs"]["tokens"]
        offsets += c["logprobs"]["text_offset"]
    return text, tokens, offsets


def test_a_token_past_a_stop_strings_cut_points_at_the_texts_end():
    """"abc" then "XY" (the stop string, cut): Y started at 4, past the 3 characters."""
    tok = byte_tokenizer()
    req = CompletionRequest(prompt="ab", max_tokens=3, logprobs=0, echo=True, stop=["XY"])
    served = ServedModel("tiny", tok, 256, 64, 8)
    ids = [ord(c) for c in "cXY"]
    entries = [TokenLogprobs(t, -1.0, 1) for t in ids]
    submission = SimpleNamespace(prompt_logprobs=[None])

    def fmt() -> CompletionFormat:
        return CompletionFormat(req, served, ["ab"], [[97, 98]], submission)
    done = fmt().choice(Choice(0, "c", ids, entries, "stop"))
    assert (done["text"], done["logprobs"]["text_offset"]) == ("abc", [0, 1, 2, 3, 3])
    stream = fmt()
    chunks = [stream.chunk(Delta(0, text, [t], [e], reason)) for text, t, e, reason in
              zip(["c", "", ""], ids, entries, [None, None, "stop"])]
    assert "".join(c["text"] for c in chunks) == "abc"
    assert sum((c["logprobs"]["text_offset"] for c in chunks), []) == [0, 1, 2, 3, 3]
