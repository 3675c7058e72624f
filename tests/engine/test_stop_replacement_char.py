"""A stop string is looked for only in what the model wrote: on the last token the text is
flushed, and a character the tokens leave incomplete (max_tokens cut it) decodes to U+FFFD, a
stand-in no stop string matches. The old search ran over the flushed text, so ``stop: "\\ufffd"``
turned SmolLM2's "🎌\\ufffd" ("length", 4 tokens) into "🎌" "stop"."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.detokenize import IncrementalText

from .byte_tokenizer import byte_tokenizer
from .conftest import model

FFFD = "\ufffd"
FLAG = "🎌".encode()              # f0 9f 8e 8c


class PieceTokenizer:
    """Token id -> a piece of UTF-8 bytes; decode joins them, an incomplete or invalid
    sequence becoming U+FFFD (as a byte-level BPE's decoder)."""
    PIECES = [b"ab", b"c" + FLAG[:2], FLAG[2:], b"\x80", b"d"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def run(ids, stop, finish=False) -> IncrementalText:
    """``ids`` fed to an IncrementalText, the last one ending the sample (``finish``: it ends
    with ``finish()`` after them instead, as an aborted sample does)."""
    text = IncrementalText(PieceTokenizer(), stop)
    for i, token in enumerate(ids):
        text.add(token, last=not finish and i == len(ids) - 1)
    if finish:
        text.finish()
    return text


@pytest.mark.parametrize("finish", [False, True])
@pytest.mark.parametrize("stop", [[FFFD], ["c" + FFFD], [FFFD, "zz"]])
def test_a_cut_characters_placeholder_matches_no_stop_string(stop, finish):
    text = run([0, 1], stop, finish)         # "abc" then half of 🎌
    assert (text.text, text.stopped) == ("abc" + FFFD, False)


def test_stop_strings_before_the_cut_are_still_found_on_the_last_token():
    text = run([0, 1], ["bc", FFFD])         # "bc" ends where the cut character starts
    assert (text.text, text.stopped) == ("a", True)
    whole = run([0, 1, 2], [FFFD])           # the character completed: nothing to match
    assert (whole.text, whole.stopped) == ("abc🎌", False)


def test_a_replacement_the_bytes_spell_inside_the_text_still_stops():
    text = run([0, 3, 4, 0], [FFFD])         # "ab", a lone continuation byte, "dab"
    assert (text.text, text.stopped) == ("ab", True)


def test_max_tokens_cutting_a_character_ends_length_with_a_replacement_stop():
    """The engine's finish_reason: random weights made to say 0xE6, half of 日."""
    tok = byte_tokenizer()
    forced = dict(max_new_tokens=1, temperature=0.0, ignore_eos=True, logit_bias={0xE6: 100.0})
    with Engine(model(), tok, max_batch=2, max_context=32) as engine:
        plain, stopped = (engine.generate([[97, 98]], SamplingParams(**forced, stop=stop))[0]
                          .outputs[0] for stop in ([], [FFFD]))
    assert (plain.token_ids, plain.text, plain.finish_reason) == ([0xE6], FFFD, "length")
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == ([0xE6], FFFD, "length")
