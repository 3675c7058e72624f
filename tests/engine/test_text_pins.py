"""Pins of incremental detokenization's promises (a mutation audit): the first stop string
wins, and a tokenizer whose whole decode differs from its windows keeps the shown text."""
from __future__ import annotations

from vmemkv.runtime.engine.detokenize import IncrementalText

from .byte_tokenizer import byte_tokenizer


def _feed(text: IncrementalText, chars: str) -> str:
    return "".join(text.add(ord(c)) for c in chars)


def test_the_earliest_of_two_stop_strings_one_token_completes_ends_the_text():
    """"ab" and "b" both complete on token "b": the text ends where "ab" starts."""
    text = IncrementalText(byte_tokenizer(), stop=("b", "ab"))
    assert _feed(text, "xab") == "x"
    assert text.stopped and text.text == "x"
    included = IncrementalText(byte_tokenizer(), stop=("b", "ab"), include_stop=True)
    _feed(included, "xab")
    assert included.text == "xab"


class _WholeDecodeDiffers:
    """Ids are characters; a window of 3 or more ids decodes capitalised (as a tokenizer's
    clean-up can make the whole output decode otherwise than its windows did)."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(map(chr, ids))
        return text.capitalize() if len(ids) >= 3 else text


def test_a_whole_decode_that_differs_from_the_windows_keeps_the_shown_text_once():
    text = IncrementalText(_WholeDecodeDiffers())
    sent = text.add(ord("a")) + text.add(ord("b")) + text.add(ord("c"), last=True)
    assert text.text == sent == "abc"
