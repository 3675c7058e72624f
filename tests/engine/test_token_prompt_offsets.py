"""A prompt of token ids that ends inside a multi-byte character: the output's first tokens
finish it, decoded alone as U+FFFD (the engine's text, ``runtime/engine/detokenize.py``, keeps
it: the output's text is its tokens' decode). Each output token's ``text_offset`` is where it
starts in that text: the continuation byte at the U+FFFD, the next character after it (the old
offsets pointed it at 0 too, the U+FFFD stripped as if still partial). Streamed and not alike."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine.detokenize import IncrementalText
from vmemkv.runtime.serve.logprobs_format import StreamedTokens, TextOffsets

from .byte_tokenizer import byte_tokenizer

SUN = "日".encode()           # e6 97 a5


@pytest.mark.parametrize("output, text, offsets", [
    ([SUN[2], *b"abc"], "\ufffdabc", [0, 1, 2, 3]),                    # e6 97 | a5 a b c
    ([SUN[1], SUN[2], *b"ab"], "\ufffd\ufffdab", [0, 0, 2, 3]),         # e6 | 97 a5 a b
    # a5 | e6 97 a5 x: e6 starts 日 right after the broken character, and until 日 is whole
    # both read as one trailing U+FFFD run, in text the same as one partial character (a
    # byte-fallback tokenizer decodes e6 97 as two U+FFFD): they point at the run's start
    ([SUN[2], *SUN, *b"x"], "\ufffd日x", [0, 0, 0, 1, 2]),
    ([*SUN, *b"x"], "日x", [0, 0, 0, 1]),                               # a prompt ending whole
])
def test_output_offsets_after_a_prompt_cut_inside_a_character(output, text, offsets):
    tok = byte_tokenizer()
    engine_text = IncrementalText(tok)
    assert "".join(engine_text.add(t, last=i == len(output) - 1)
                   for i, t in enumerate(output)) == text
    found = TextOffsets(tok, start_chars=0, skip_special_tokens=True)
    assert [found.add(t) for t in output] == offsets
    for start, t in zip(offsets, output):        # each points into the text, at its character
        assert 0 <= start < len(text)
    streamed, sent = StreamedTokens(TextOffsets(tok, skip_special_tokens=True)), []
    for i, t in enumerate(output):               # one token a chunk, the text as the engine sends it
        sent += streamed.send(text if i == len(output) - 1 else "", [t], [None],
                              last=i == len(output) - 1)[2]
    assert sent == offsets
